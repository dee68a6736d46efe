"""Every ulfm operation and dtype without faults, at size 1 and 4; and the refusal without ULFM.

Run: `make test`. CPU only; launches mpirun with a hard timeout.
"""

import sys

import pytest

from megatron_recover.launch import LaunchConfig, launch_env, mpirun_command, run_bounded
from tests.mpirun_harness import WORKERS, run_worker

pytestmark = pytest.mark.mpi
TIMEOUT_S = 120


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("num_ranks", [1, 4])
def test_operations(tmp_path, num_ranks):
    run = run_worker(tmp_path, "ops_worker.py", num_ranks, ["ops"], TIMEOUT_S)
    assert not run.timed_out, run.output[-3000:]
    assert sorted(run.results) == list(range(num_ranks)), run.output[-3000:]
    for rank, result in run.results.items():
        failed = [name for name, ok in result["checks"].items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
    if num_ranks > 1:
        assert "wait_timeout_raises" in run.results[0]["checks"]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("num_ranks", [1, 4])
def test_training_state_travels_tensor_by_tensor(tmp_path, num_ranks):
    """`transfer.broadcast_state` with packs and chunks lowered (structure, dtypes and a state
    dict's `_metadata` arrive intact); with 4 ranks, a join's transfer whose donor dies inside
    the big tensor is finished by the next survivor."""
    run = run_worker(tmp_path, "ops_worker.py", num_ranks, ["state"], TIMEOUT_S)
    assert not run.timed_out, run.output[-3000:]
    expected = list(range(1, num_ranks)) if num_ranks == 4 else [0]
    assert sorted(run.results) == expected, run.output[-3000:]
    assert [m["rank"] for m in run.markers] == ([0] if num_ranks == 4 else [])
    for rank, result in run.results.items():
        failed = [name for name, ok in result["checks"].items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
    if num_ranks == 4:
        assert all("transfer_state" in r["checks"] for r in run.results.values())


@pytest.mark.long
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_transfers_over_1_gib(tmp_path):
    """A broadcast and an all-gather of more than 1 GiB (one MPI call's most) at the default
    chunk size, byte for byte, on 2 ranks."""
    run = run_worker(tmp_path, "ops_worker.py", 2, ["big"], TIMEOUT_S)
    assert not run.timed_out, run.output[-3000:]
    assert sorted(run.results) == [0, 1], run.output[-3000:]
    for rank, result in run.results.items():
        checks = result["checks"]
        assert checks["broadcast_over_1gib"] and checks["allgather_over_1gib"], (rank, checks)
        print(f"rank {rank}: broadcast {checks['broadcast_seconds']:.2f} s, all-gather "
              f"{checks['allgather_seconds']:.2f} s")


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_refuses_without_fault_tolerance(tmp_path):
    """mpirun without --with-ft ulfm: group creation stops with a message saying how to relaunch."""
    cfg = LaunchConfig(1, [sys.executable, str(WORKERS / "ops_worker.py"), "no-ft", str(tmp_path),
                           str(tmp_path / "markers")], tmp_path / "status")
    rc, output, _ = run_bounded(mpirun_command(cfg, fault_tolerant=False), launch_env(cfg),
                                TIMEOUT_S)
    assert rc is not None, output
    result = (tmp_path / "result-0.json").read_text()
    assert "--with-ft ulfm" in result, output
