"""The non-blocking restore before an extension pass (`GradientRecovery.rewind_under_pass`).

Run: .venv/bin/python -m pytest tests/unit/test_restore_stream.py   (no MPI, no GPU)

What it checks: the buckets come back to their snapshots (a deferred one empty, its snapshot
added after the pass) with the ledgers to match; on CUDA the copies are enqueued on the side
stream after the compute stream's work, and the compute stream waits for them exactly once
(recorded with stand-in streams: these machines have no GPU, and the stream calls' effect on a
device is `make gpu-check`'s to show).
"""

import contextlib

import pytest
import torch

from megatron_recover.recovery.gradients import GradientRecovery
from megatron_recover.recovery.ledger import Entry, Ledger

pytestmark = pytest.mark.unit


def recovery_with_snapshots(restore_stream=None):
    """Two buckets, the second deferred, reduced once: snapshots hold (1, 2, 3) and (10, 20),
    the ledgers microbatch 0; the buckets then hold a reduced sum (junk for the restore)."""
    plain, deferred = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0])
    recovery = GradientRecovery(None, [plain, deferred], deferred=[deferred], synced=[deferred],
                                restore_stream=restore_stream)
    recovery._post = lambda bucket: None  # no group: only the snapshot side of reduce_bucket
    recovery.begin_iteration()
    recovery.begin_pass()
    recovery.register(1, 0, 111)
    recovery.reduce_all()
    plain.fill_(99.0)
    deferred.fill_(99.0)
    return recovery, plain, deferred


def run_extension(recovery, plain, deferred):
    """What the trainer does around an extension pass of microbatch 7 (gradient 0.5 per
    element): rewind, the pass's forward and backward, the compute stream's wait, the deferred
    snapshots back."""
    recovery.begin_pass()
    recovery.rewind_under_pass()
    recovery.restored()  # the pass runner's sink, after the first forward
    plain.add_(0.5)
    deferred.add_(0.5)
    recovery.register(1, 7, 777)
    recovery.restored()  # the trainer, before the reductions
    recovery.add_synced_snapshots()


def test_the_pass_accumulates_on_the_snapshots_and_the_ledger_follows():
    recovery, plain, deferred = recovery_with_snapshots()
    run_extension(recovery, plain, deferred)
    assert plain.tolist() == [1.5, 2.5, 3.5] and deferred.tolist() == [10.5, 20.5]
    expected = Ledger()
    expected.register(Entry(1, 0, 111))
    expected.register(Entry(1, 7, 777))
    for bucket in recovery._buckets.values():
        assert bucket.ledger == expected, bucket.index


class Recorder:
    """A stand-in stream: records what is asked of it, in one shared log."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")

    def record_event(self):
        self.log.append(f"{self.name} records")
        return f"event of {self.name}"

    def wait_event(self, event):
        self.log.append(f"{self.name} waits {event}")


def test_on_cuda_the_copies_go_to_the_side_stream_and_the_compute_stream_waits_once(monkeypatch):
    log = []
    compute, side = Recorder("compute", log), Recorder("side", log)
    recovery, plain, deferred = recovery_with_snapshots(restore_stream=side)

    @contextlib.contextmanager
    def stream(s):  # torch.cuda.stream: the buckets' state on entry and exit shows where
        log.append(f"enter {s.name}: {plain.tolist()} {deferred.tolist()}")  # the copies ran
        yield
        log.append(f"exit {s.name}: {plain.tolist()} {deferred.tolist()}")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    run_extension(recovery, plain, deferred)
    assert log == [
        "side waits compute",  # after whatever the compute stream did to the buckets
        "enter side: [99.0, 99.0, 99.0] [99.0, 99.0]",
        "exit side: [1.0, 2.0, 3.0] [0.0, 0.0]",
        "side records",
        "compute waits event of side",  # once: at the first forward, not again before reducing
    ]
    assert plain.tolist() == [1.5, 2.5, 3.5] and deferred.tolist() == [10.5, 20.5]


def test_without_a_stream_nothing_waits(monkeypatch):
    def no_stream(*args, **kwargs):
        raise AssertionError("a stream call on the CPU path")

    monkeypatch.setattr(torch.cuda, "current_stream", no_stream)
    monkeypatch.setattr(torch.cuda, "stream", no_stream)
    recovery, plain, deferred = recovery_with_snapshots()
    run_extension(recovery, plain, deferred)
    assert plain.tolist() == [1.5, 2.5, 3.5]
