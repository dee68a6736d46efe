"""The classification of errors raised on a rank (megatron_recover/failures.py,
docs/failures.md), and the failure schedule's actions that raise.

Run: .venv/bin/python -m pytest tests/unit/test_failures.py   (no MPI; seconds)
"""

import pytest
import torch
import torch.distributed as dist

from megatron_recover import failures
from megatron_recover.collective import CollectiveTimeout
from megatron_recover.faults.schedule import InjectedError, ScheduledFaults, load_schedule

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("error, kind", [
    (CollectiveTimeout("a ulfm wait outlived the bound"), failures.PEER_LOST),
    (dist.DistBackendError("a peer died"), failures.PEER_LOST),
    (dist.DistNetworkError("connection reset"), failures.PEER_LOST),
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
     failures.DEVICE),
    (failures.DeviceFault("injected"), failures.DEVICE),
    (ValueError("a bad sample"), failures.PROGRAM),
    (torch.cuda.OutOfMemoryError("at this batch shape"), failures.PROGRAM),
    # gloo's only report of a dead peer: its text is not read.
    (RuntimeError("Connection closed by peer [127.0.0.1]:1234"), failures.PROGRAM),
])
def test_typed_errors_are_classified(error, kind):
    assert failures.classify(error) == kind


def test_an_error_raised_from_a_typed_one_takes_its_kind():
    try:
        try:
            raise dist.DistBackendError("a peer died")
        except RuntimeError as inner:
            raise RuntimeError("megatron's schedule failed") from inner
    except RuntimeError as outer:
        assert failures.classify(outer) == failures.PEER_LOST


def test_an_untyped_error_is_a_lost_peer_when_mpi_reports_one():
    error = RuntimeError("Connection closed by peer")
    assert failures.classify(error, peer_failed=True) == failures.PEER_LOST
    assert failures.classify(ValueError("x"), peer_failed=True) == failures.PEER_LOST


def test_the_place_is_described():
    failures.note(None)
    assert failures.describe(failures.where()) == "outside the training iterations"
    failures.note(4)
    assert failures.describe(failures.where()) == (
        "in iteration 4, outside a microbatch's forward and backward")
    failures.note(4, 8)
    assert failures.describe(failures.where()) == "in iteration 4, microbatch 8"


def test_schedule_actions_raise_where_they_are_due(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("entries:\n"
                    "  - {iteration: 2, replica: 0, local_rank: 0, location: backward, "
                    "action: raise}\n"
                    "  - {iteration: 3, replica: 1, local_rank: 0, location: pre-forward, "
                    "action: device-error}\n")
    entries = load_schedule(path, num_replicas=2, ranks_per_replica=1, train_iters=4)
    program = ScheduledFaults(entries, 0, 0, 0, tmp_path / "markers")
    program.at("backward", 1)  # not due
    with pytest.raises(InjectedError):
        program.at("backward", 2)
    device = ScheduledFaults(entries, 1, 0, 1, tmp_path / "markers")
    with pytest.raises(failures.DeviceFault):
        device.at("pre-forward", 3)
    assert failures.classify(failures.DeviceFault("x")) == failures.DEVICE
    assert failures.classify(InjectedError("x")) == failures.PROGRAM


@pytest.mark.parametrize("location", ["during-reduce", "during-consensus", "join-transfer"])
def test_raising_actions_are_refused_off_the_main_thread(tmp_path, location):
    path = tmp_path / "s.yaml"
    path.write_text(f"entries:\n  - {{iteration: 1, replica: 0, local_rank: 0, "
                    f"location: {location}, action: raise}}\n")
    with pytest.raises(ValueError, match="raises on the main thread"):
        load_schedule(path, num_replicas=2, ranks_per_replica=1, train_iters=2)
