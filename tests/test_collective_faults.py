"""Fault matrix for the ulfm backend: SIGKILL ranks at named points of a collective.

Run: `make test` (or `.venv/bin/python -m pytest tests/test_collective_faults.py -v`). CPU only;
each case launches mpirun --with-ft ulfm with 4 or 8 oversubscribed ranks under a hard timeout.

A "delay" fault holds one survivor back before the hit operation, so the operation cannot
complete anywhere before the victim dies inside it. Each case asserts: the victims' markers exist
(the kills happened), every survivor finished (nobody hung), every survivor saw the failure from
the operation that was hit, the consensus record is identical on all survivors, the epoch advanced
once per repair record, and the next all-reduce over the survivors gives the exact sum.
"""

import pytest

from megatron_recover.faults import Fault
from tests.mpirun_harness import run_worker

pytestmark = pytest.mark.mpi
TIMEOUT_S = 150

# id -> (ranks, scenario, fault specs)
CASES = {
    "before-4": (4, "allreduce", ["3:before"]),
    "before-8": (8, "allreduce", ["6:before"]),
    "reduce-4": (4, "allreduce", ["2:reduce", "1:delay-reduce@0.3"]),
    "reduce-8": (8, "allreduce", ["5:reduce", "1:delay-reduce@0.3"]),
    "reduce-rank0-4": (4, "allreduce", ["0:reduce", "1:delay-reduce@0.3"]),
    # Tensors staged through host buffers, as CUDA tensors are: a failed one is left untouched.
    "staged-reduce-4": (4, "staged-allreduce", ["2:reduce", "1:delay-reduce@0.3"]),
    "consensus-4": (4, "consensus", ["1:consensus", "0:delay-consensus@0.3"]),
    "consensus-8": (8, "consensus", ["7:consensus", "0:delay-consensus@0.3"]),
    "shrink-4": (4, "allreduce", ["3:before", "2:shrink@0.2", "0:delay-shrink@0.6"]),
    "shrink-8": (8, "allreduce", ["5:before", "2:shrink@0.2", "0:delay-shrink@0.6"]),
    "two-at-once-4": (4, "allreduce", ["1:reduce", "3:reduce", "0:delay-reduce@0.3"]),
    "two-at-once-8": (8, "allreduce", ["2:reduce", "6:reduce", "0:delay-reduce@0.3"]),
    "64mib-4": (4, "allreduce64m", ["2:reduce", "1:delay-reduce@0.3"]),
    # A member dies between two chunks of one transfer (chunks lowered to 64 KiB).
    "broadcast-chunks-4": (4, "broadcast-chunks", ["2:broadcast-chunk:3"]),
    "broadcast-root-chunks-4": (4, "broadcast-chunks", ["0:broadcast-chunk:5"]),
    "allgather-chunks-4": (4, "allgather-chunks", ["1:allgather-chunk:2"]),
    "disjoint-groups-8": (8, "disjoint", ["1:reduce", "0:delay-reduce@0.3", "6:reduce",
                                          "4:delay-reduce@0.3"]),
}


def victims_of(specs: list[str]) -> set[int]:
    return {f.rank for f in map(Fault.parse, specs) if f.action == "kill"}


def check_survivors(run, members: list[int], victims: set[int], hit_is_consensus: bool,
                    uniform: bool = True, staged: bool = False) -> None:
    survivors = [r for r in members if r not in victims]
    assert sorted(r for r in run.results if r in members) == survivors, run.output[-3000:]
    expected_failed = sorted(victims & set(members))
    consensus_records = []
    for rank in survivors:
        res = run.results[rank]
        warmup, hit = res["ops"]
        assert not warmup["failed"], f"rank {rank}: failure reported before the fault"
        if uniform:
            assert hit["failed"] and hit["failed_ranks"] == expected_failed, (rank, hit)
        if staged:
            assert hit["untouched"], (rank, hit)
        repairs = sum(op["repaired"] for op in res["ops"]) + res["consensus"]["repaired"]
        assert res["epoch"] == repairs == 1, (rank, res["epoch"], repairs)
        consensus = res["consensus"]
        # A consensus reports failures since the previous one; when the hit operation was itself
        # a consensus, it already reported them.
        assert consensus["failed_ranks"] == ([] if hit_is_consensus else expected_failed)
        assert consensus["census"] == [len(survivors), sum(survivors)]
        consensus_records.append({k: consensus[k] for k in ("failed_ranks", "epoch", "size",
                                                            "census")})
        verify = res["verify"]
        assert not verify["record"]["failed"] and verify["exact"], (rank, verify)
        assert verify["expected"] == sum(r + 1 for r in survivors)
        if "verify_transfer" in res:
            assert (not res["verify_transfer"]["record"]["failed"]
                    and res["verify_transfer"]["exact"]), (rank, res["verify_transfer"])
        if "verify64m" in res:
            assert not res["verify64m"]["record"]["failed"] and res["verify64m"]["exact"]
    assert all(rec == consensus_records[0] for rec in consensus_records), consensus_records
    if not uniform:
        assert any(run.results[r]["ops"][1]["failed"] for r in survivors)


@pytest.mark.timeout(TIMEOUT_S + 30)
# `make test` runs the 4-rank cases, `make test-long` the 8-rank ones too.
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.long] if CASES[c][0] > 4
                                               else []) for c in CASES])
def test_fault_case(tmp_path, case):
    num_ranks, scenario, specs = CASES[case]
    run = run_worker(tmp_path, "collective_worker.py", num_ranks, [scenario, *specs], TIMEOUT_S)
    assert not run.timed_out, f"{case}: hung (killed after {TIMEOUT_S}s)\n{run.output[-3000:]}"
    victims = victims_of(specs)
    kill_points = {f.rank: f.point for f in map(Fault.parse, specs) if f.action == "kill"}
    assert {m["rank"]: m["point"] for m in run.markers} == kill_points, run.markers
    print(f"{case}: {num_ranks} ranks, victims {sorted(victims)}, {run.elapsed_s:.1f}s")
    if scenario == "disjoint":
        half = num_ranks // 2
        for members in (list(range(half)), list(range(half, num_ranks))):
            check_survivors(run, members, victims, hit_is_consensus=False)
    else:
        check_survivors(run, list(range(num_ranks)), victims,
                        hit_is_consensus=scenario == "consensus",
                        staged=scenario.startswith("staged-"))


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_fault_without_per_op_agreement(tmp_path):
    """Default mode (no agreement per operation): the consensus still gives one agreed view."""
    specs = ["2:reduce", "1:delay-reduce@0.3"]
    run = run_worker(tmp_path, "collective_worker.py", 4, ["allreduce", *specs, "--fast"],
                     TIMEOUT_S)
    assert not run.timed_out, run.output[-3000:]
    assert [m["rank"] for m in run.markers] == [2]
    check_survivors(run, [0, 1, 2, 3], {2}, hit_is_consensus=False, uniform=False)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_torch_distributed_call_fails_stop(tmp_path):
    """A stock caller (dist.all_reduce on the group) that sees a death raises, as on gloo; the
    group is repaired all the same, and the record API goes on over the survivors."""
    specs = ["2:reduce", "1:delay-reduce@0.3"]
    run = run_worker(tmp_path, "collective_worker.py", 4, ["torch-allreduce", *specs], TIMEOUT_S)
    assert not run.timed_out, run.output[-3000:]
    assert [m["rank"] for m in run.markers] == [2], run.markers
    assert sorted(run.results) == [0, 1, 3], run.output[-3000:]
    for rank, res in run.results.items():
        warmup, hit = res["ops"]
        assert not warmup["failed"], rank
        assert "ALLREDUCE failed: a peer died (world ranks [2];" in hit["raised"], hit
        assert (hit["epoch"], hit["size"]) == (1, 3), (rank, hit)
        assert res["consensus"]["failed_ranks"] == [2] and res["epoch"] == 1, res["consensus"]
        assert res["verify"]["exact"] and res["verify"]["expected"] == 1 + 2 + 4, res["verify"]


# The torch data plane (`collective/torch_plane.py`): the same worker with --torch-plane, gloo
# carrying the data operations and the ulfm group the control plane. id -> (scenario, specs).
TORCH_PLANE_CASES = {
    "before": ("allreduce", ["3:before"]),
    "inside": ("allreduce", ["2:reduce", "1:delay-reduce@0.3"]),
    "lowest-rank": ("allreduce", ["0:reduce", "1:delay-reduce@0.3"]),  # the rebuild's host
    "two-at-once": ("allreduce", ["1:reduce", "3:reduce", "0:delay-reduce@0.3"]),
    # The reduction completed everywhere; the victim dies entering the consensus after it.
    "after": ("allreduce", ["2:consensus"]),
    # A second victim dies inside the rebuild, after the handles were exchanged.
    "during-reconfigure": ("allreduce", ["3:before", "2:reconfigure"]),
    "64mib": ("allreduce64m", ["2:reduce", "1:delay-reduce@0.3"]),
    "broadcast": ("broadcast-chunks", ["2:broadcast"]),
    "broadcast-root": ("broadcast-chunks", ["0:broadcast"]),
    "allgather": ("allgather-chunks", ["1:allgather"]),
}


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("case", list(TORCH_PLANE_CASES))
def test_torch_plane_fault_case(tmp_path, case):
    """A member killed before, inside or after a data operation of the torch plane, or during
    its rebuild: the fault fired; an all-reduce hit failed on every survivor (killed after it,
    on none; a transfer the victim had received or sent in full before it died may complete),
    every survivor left the consensus with the same record naming exactly the
    victims, the data epoch advanced past the warm-up's, and the next operation over the
    survivors is exact."""
    scenario, specs = TORCH_PLANE_CASES[case]
    run = run_worker(tmp_path, "collective_worker.py", 4, [scenario, *specs, "--torch-plane"],
                     TIMEOUT_S)
    assert not run.timed_out, f"{case}: hung (killed after {TIMEOUT_S}s)\n{run.output[-3000:]}"
    victims = victims_of(specs)
    kill_points = {f.rank: f.point for f in map(Fault.parse, specs) if f.action == "kill"}
    assert {m["rank"]: m["point"] for m in run.markers} == kill_points, run.markers
    survivors = [r for r in range(4) if r not in victims]
    assert sorted(run.results) == survivors, run.output[-3000:]
    records = []
    for rank in survivors:
        res = run.results[rank]
        warmup, hit = res["ops"]
        assert not warmup["failed"], (rank, warmup)
        assert hit["failed"] == hit["broken"] and not hit["failed_ranks"], (rank, hit)
        consensus = res["consensus"]
        assert sorted(consensus["failed_ranks"]) == sorted(victims), (rank, consensus)
        assert consensus["census"] == [len(survivors), sum(survivors)], (rank, consensus)
        assert res["epoch"] == consensus["epoch"] > warmup["epoch"], (rank, res["epoch"])
        verify = res["verify"]
        assert not verify["record"]["failed"] and verify["exact"], (rank, verify)
        assert verify["expected"] == sum(r + 1 for r in survivors)
        for again in ("verify_transfer", "verify64m"):
            if again in res:
                assert not res[again]["record"]["failed"] and res[again]["exact"], (rank, res)
        records.append({k: consensus[k] for k in ("failed_ranks", "epoch", "size", "census")})
    assert all(record == records[0] for record in records), records
    hit_failed = [run.results[r]["ops"][1]["failed"] for r in survivors]
    if case == "after":
        assert not any(hit_failed), hit_failed
    elif scenario.startswith("allreduce"):  # the victim's part never arrived: it cannot succeed
        assert all(hit_failed), hit_failed
    print(f"torch plane {case}: victims {sorted(victims)}, hit failed on "
          f"{sum(hit_failed)} of {len(survivors)} survivors, {run.elapsed_s:.1f}s")
