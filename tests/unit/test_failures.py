"""The classification of errors raised on a rank (megatron_recover/errors.py,
docs/failures.md), and the failure schedule's actions that raise.

Run: .venv/bin/python -m pytest tests/unit/test_failures.py   (no MPI; seconds)
"""

import errno
import os

import mpi4py
import pytest
import torch
import torch.distributed as dist

mpi4py.rc.initialize = False  # error classes need no MPI_Init, and this process starts no MPI
from mpi4py import MPI  # noqa: E402

mpi4py.rc.initialize = True

from megatron_recover import errors
from megatron_recover.collective import CollectiveTimeout
from megatron_recover.faults.schedule import InjectedError, ScheduledFaults, load_schedule

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("error, kind", [
    (CollectiveTimeout("a ulfm wait outlived the bound"), errors.PEER_LOST),
    (dist.DistBackendError("a peer died"), errors.PEER_LOST),
    (dist.DistNetworkError("connection reset"), errors.PEER_LOST),
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
     errors.DEVICE),
    (errors.DeviceFault("injected"), errors.DEVICE),
    (errors.NonFiniteResult("found NaN in local grad norm"), errors.DEVICE),
    (errors.NonFiniteLoss("found NaN in local forward loss calculation"), errors.PROGRAM),
    (errors.SilentCorruption("a fingerprint two replicas contradict"), errors.DEVICE),
    (errors.UnresolvedCorruption("no third replica"), errors.PROGRAM),
    (ValueError("a bad sample"), errors.PROGRAM),
    (torch.cuda.OutOfMemoryError("at this batch shape"), errors.PROGRAM),
    # gloo's only report of a dead peer: its text is not read.
    (RuntimeError("Connection closed by peer [127.0.0.1]:1234"), errors.PROGRAM),
    # mpirun is gone (the job is being torn down): writing to the terminal fails.
    (OSError(errno.EIO, "Input/output error"), errors.PEER_LOST),
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), errors.PEER_LOST),
    (FileNotFoundError(errno.ENOENT, "no such file"), errors.PROGRAM),
    # ULFM's classes for a dead peer or a revoked communicator (a start-up call that met a dead
    # rank raises one); any other MPI error is the program's unless MPI reports a failed peer.
    (MPI.Exception(MPI.ERR_PROC_FAILED), errors.PEER_LOST),
    (MPI.Exception(MPI.ERR_PROC_FAILED_PENDING), errors.PEER_LOST),
    (MPI.Exception(MPI.ERR_REVOKED), errors.PEER_LOST),
    (MPI.Exception(MPI.ERR_OTHER), errors.PROGRAM),
])
def test_typed_errors_are_classified(error, kind):
    assert errors.classify(error) == kind


def test_an_error_raised_from_a_typed_one_takes_its_kind():
    try:
        try:
            raise dist.DistBackendError("a peer died")
        except RuntimeError as inner:
            raise RuntimeError("megatron's schedule failed") from inner
    except RuntimeError as outer:
        assert errors.classify(outer) == errors.PEER_LOST


def test_an_untyped_error_is_a_lost_peer_when_mpi_reports_one():
    error = RuntimeError("Connection closed by peer")
    assert errors.classify(error, lambda: True) == errors.PEER_LOST
    assert errors.classify(ValueError("x"), lambda: True) == errors.PEER_LOST
    asked = []
    assert errors.classify(errors.DeviceFault("x"), lambda: asked.append(1)) == (
        errors.DEVICE)
    assert not asked  # MPI is asked only when no typed kind is found


class Left(BaseException):
    """Stands for the SIGKILL or the end of the job: the hook never returns."""


@pytest.fixture
def hook(monkeypatch):
    """runtime's exit hook with its ways out recorded instead of taken."""
    from megatron_recover import runtime

    seen = {"status": None, "ended_job": False, "terminal": []}

    def kill(pid, sig):
        raise Left("SIGKILL")

    def end_job(daemon):
        seen["ended_job"] = daemon
        raise Left("job ended")

    monkeypatch.setattr(runtime, "write_status", lambda state, **f: seen.update(
        status={"state": state, **f}))
    monkeypatch.setattr(runtime, "write_to_terminal", seen["terminal"].append)
    monkeypatch.setattr(runtime, "_end_children", lambda: None)
    monkeypatch.setattr(runtime, "_end_job", end_job)
    monkeypatch.setattr(runtime, "_open_mpi_daemon", lambda: seen.get("daemon", 4242))
    monkeypatch.setattr(runtime.os, "kill", kill)
    monkeypatch.setattr(runtime, "_replica_peer_failed", lambda wait_s: seen.get("peer", False))
    monkeypatch.setitem(runtime._state, "program_errors", None)

    def die(error, policy=None, peer=False):
        runtime._state["program_errors"] = policy
        seen["peer"] = peer
        seen["ended_job"] = False
        with pytest.raises(Left):
            runtime._die_on_uncaught(type(error), error, None)
        return seen
    return die


def test_a_program_error_under_recover_ends_the_job_with_its_place(hook):
    errors.note(4, 8)
    seen = hook(ValueError("a bad sample"), policy=errors.ABORT)
    assert seen["ended_job"]
    assert seen["status"]["state"] == "error" and seen["status"]["ended_job"] is True
    assert (seen["status"]["iteration"], seen["status"]["microbatch_id"]) == (4, 8)
    assert "a program error in iteration 4, microbatch 8" in seen["terminal"][0]


def test_what_leaves_the_rank_instead(hook):
    errors.note(4, 8)
    cases = [(ValueError("x"), errors.SURVIVE, False, "left"),  # asked to survive
             (ValueError("x"), None, False, "error"),  # stock run: stops as before
             (dist.DistBackendError("a peer died"), errors.ABORT, False, "left"),
             (RuntimeError("Connection closed by peer"), errors.ABORT, True, "left"),
             (errors.DeviceFault("x"), errors.ABORT, False, "left")]
    for error, policy, peer, state in cases:
        seen = hook(error, policy=policy, peer=peer)
        assert not seen["ended_job"], error
        assert seen["status"]["state"] == state, (error, seen["status"])
        assert "ended_job" not in seen["status"]


def test_a_program_error_while_mpirun_is_gone_only_leaves(hook, monkeypatch):
    """No Open MPI daemon among the ancestors: the job is being torn down (a lost node); the
    rank must not report that it ended the job (the relauncher would then not relaunch)."""
    from megatron_recover import runtime

    monkeypatch.setattr(runtime, "_open_mpi_daemon", lambda: None)
    seen = hook(ValueError("x"), policy=errors.ABORT)
    assert not seen["ended_job"]
    assert "ended_job" not in seen["status"]


def test_a_failing_classification_still_takes_the_rank_down(hook, monkeypatch):
    def broken(*args):
        raise RuntimeError("MPI is gone")

    monkeypatch.setattr(errors, "classify", broken)
    seen = hook(ValueError("x"), policy=errors.ABORT)
    assert not seen["ended_job"]
    assert seen["status"]["state"] == "left" and seen["status"]["kind"] == errors.PEER_LOST


def test_the_place_is_described():
    errors.note(None)
    assert errors.describe(errors.where()) == "outside the training iterations"
    errors.note(4)
    assert errors.describe(errors.where()) == (
        "in iteration 4, outside a microbatch's forward and backward")
    errors.note(4, 8)
    assert errors.describe(errors.where()) == "in iteration 4, microbatch 8"


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
    with pytest.raises(errors.DeviceFault):
        device.at("pre-forward", 3)
    assert errors.classify(errors.DeviceFault("x")) == errors.DEVICE
    assert errors.classify(InjectedError("x")) == errors.PROGRAM


def test_the_nan_action_poisons_once_and_only_at_backward(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("entries:\n  - {iteration: 2, replica: 0, local_rank: 0, location: backward, "
                    "action: nan}\n")
    faults = ScheduledFaults(load_schedule(path, num_replicas=1, ranks_per_replica=1,
                                           train_iters=4), 0, 0, 0, tmp_path / "markers")
    assert [faults.at("backward", t) for t in (1, 2, 3)] == [False, True, False]
    path.write_text("entries:\n  - {iteration: 2, replica: 0, local_rank: 0, "
                    "location: pre-forward, action: nan}\n")
    with pytest.raises(ValueError, match="action nan poisons a microbatch's backward"):
        load_schedule(path, num_replicas=1, ranks_per_replica=1, train_iters=4)


def test_the_bitflip_action_flips_one_bit_once_before_the_reduction(tmp_path):
    from megatron_recover.faults.injection import read_markers

    path = tmp_path / "s.yaml"
    path.write_text("entries:\n  - {iteration: 2, replica: 0, local_rank: 0, "
                    "location: before-reduce, action: bitflip}\n")
    faults = ScheduledFaults(load_schedule(path, num_replicas=1, ranks_per_replica=1,
                                           train_iters=4), 0, 0, 0, tmp_path / "markers")
    grad = torch.zeros(10)
    grad[7] = 3e-3  # the middle element is zero: the first non-zero one after it is flipped
    before = grad.clone()
    assert faults.at("before-reduce", 2) is False  # `at` leaves it to `corrupt`
    faults.corrupt(1, grad)
    assert torch.equal(grad, before)
    faults.corrupt(2, grad)
    changed = (grad != before).nonzero().flatten().tolist()
    assert changed == [7] and float(grad[7]) == pytest.approx(3e-3 / 2 ** 16)  # bit 27 was set
    faults.corrupt(2, grad)  # once: a restore's reduction is not flipped back
    assert changed == (grad != before).nonzero().flatten().tolist()
    [marker] = read_markers(tmp_path / "markers")
    assert (marker["element"], marker["bit"], marker["action"]) == (7, 27, "bitflip")
    for bad, why in [("location: backward, action: bitflip", "give it location before-reduce"),
                     ("location: pre-forward, bit: 3", "'bit' goes with action bitflip"),
                     ("location: before-reduce, action: bitflip, bit: 64", "between 0 and 63")]:
        path.write_text(f"entries:\n  - {{iteration: 2, replica: 0, local_rank: 0, {bad}}}\n")
        with pytest.raises(ValueError, match=why):
            load_schedule(path, num_replicas=1, ranks_per_replica=1, train_iters=4)


@pytest.mark.parametrize("location", ["during-reduce", "during-consensus", "join-transfer"])
def test_raising_actions_are_refused_off_the_main_thread(tmp_path, location):
    path = tmp_path / "s.yaml"
    path.write_text(f"entries:\n  - {{iteration: 1, replica: 0, local_rank: 0, "
                    f"location: {location}, action: raise}}\n")
    with pytest.raises(ValueError, match="raises on the main thread"):
        load_schedule(path, num_replicas=2, ranks_per_replica=1, train_iters=2)


@pytest.mark.parametrize("timeout_s", [3.0, 60.0, 120.0])
def test_the_failure_detector_beats_more_than_three_times_per_timeout(monkeypatch, timeout_s):
    """Open MPI requires the detector's timeout to exceed 3 heartbeat periods; at 2 a live rank
    was reported dead and aborted in a failure-free CI run (docs/ulfm-behaviour.md)."""
    from megatron_recover import runtime

    for name in ("detector", "detector_thread", "detector_timeout", "detector_period"):
        monkeypatch.delenv(f"OMPI_MCA_mpi_ft_{name}", raising=False)
    runtime.configure_hang_detection(timeout_s)
    timeout = float(os.environ["OMPI_MCA_mpi_ft_detector_timeout"])
    period = float(os.environ["OMPI_MCA_mpi_ft_detector_period"])
    assert timeout == timeout_s and timeout > 3 * period, (timeout, period)
