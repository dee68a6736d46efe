"""Grow back: standby replicas (--recover-standby-replicas) replace lost replicas at an iteration
boundary, and exact mode still gives the failure-free loss curve and parameters.

Run: `make test`. CPU only (megatron-core under the CPU emulation): 4 training ranks + 2 standby
ranks, oversubscribed, every run under a hard timeout. The reference is the same command with no
failures, standbys included: they stay idle and are dismissed at the end.
"""

import pytest

from megatron_recover.faults import read_markers
from megatron_recover.launch import LaunchConfig, launch
from tests.mpirun_harness import ENTRY
from tests.training_harness import (
    STABLE_LR,
    assert_ledger_held,
    loss_rdiff,
    param_rdiff,
    run_training,
    EXACT_LOSS_RTOL,
    EXACT_PARAM_RTOL,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
TIMEOUT_S = 300
REPLICAS = 4
STANDBYS = 2
ITERATIONS = 8
B = 8
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--eval-iters", "0",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", str(B), "--train-iters", str(ITERATIONS), *STABLE_LR,
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--log-interval", "1",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
         "--recover-standby-replicas", str(STANDBYS)]
STANDBY_RANKS = list(range(REPLICAS, REPLICAS + STANDBYS))


def train(tmp_path, name, schedule=None, extra=()):
    return run_training(tmp_path / name, REPLICAS + STANDBYS, [*MODEL, *extra], schedule,
                        TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = train(tmp_path_factory.mktemp("reference"), "reference")
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    return run


def joins(run) -> list[tuple]:
    """(replicas, standby ranks, the iteration after which they joined) of each join."""
    return [(e["replicas"], e["ranks"], e["after_iteration"])
            for r in run.records for e in r["events"] if e["event"] == "join"]


def assert_exact_everywhere(run, reference, ranks: list[int]) -> None:
    """Losses equal the reference's, and each of `ranks` holds the reference's final parameters
    (every replica holds the same ones: compared with the reference's rank 0)."""
    loss = loss_rdiff(run.records, reference.records)
    params = max(param_rdiff(run.params(r), reference.params(0)) for r in ranks)
    print(f"max relative loss diff {loss:.2e}, final parameters {params:.2e} (ranks {ranks})")
    assert loss <= EXACT_LOSS_RTOL and params <= EXACT_PARAM_RTOL, (loss, params)
    digests = {r: run.result.statuses[r]["param_digest"] for r in ranks}
    assert len(set(digests.values())) == 1, digests


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_idle_standbys_leave_at_the_end(reference):
    """No failure: nobody is called, both standbys are dismissed and record it."""
    assert joins(reference) == []
    assert [r["live_replicas"] for r in reference.records] == [REPLICAS] * ITERATIONS
    for rank in STANDBY_RANKS:
        status = reference.result.statuses[rank]
        assert status["state"] == "completed" and status["standby"] == "idle", status
        assert status["reason"] == "dismissed at the end of training", status
        # Waiting used a small share of a core (a blocking receive would use all of it).
        assert status["wait_cpu_s"] < 0.2 * status["waited_s"], status
    assert_ledger_held(reference.records, B)


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_two_standbys_replace_two_lost_replicas(tmp_path, reference):
    """Iteration 2: replica 1 dies inside a bucket's all-reduce (a policy boundary); standby
    rank 4 takes its id. Iteration 5: that joiner dies entering the gradient-norm all-reduce of
    the optimizer step, after the iteration's commit; the survivors learn of it in iteration 6,
    and standby rank 5 takes replica id 1 after that."""
    schedule = """entries:
  - {iteration: 2, replica: 1, local_rank: 0, location: during-reduce}
  - {iteration: 5, replica: 1, local_rank: 0, location: grad-norm}
"""
    run = train(tmp_path, "grow", schedule)
    assert sorted((m["rank"], m["iteration"], m["location"]) for m in run.markers) == [
        (1, 2, "during-reduce"), (4, 5, "grad-norm")]
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    assert_ledger_held(run.records, B)
    assert [r["live_replicas"] for r in run.records] == [4, 3, 4, 4, 4, 3, 4, 4]
    assert joins(run) == [([1], [4], 2), ([1], [5], 6)]
    joined = run.result.statuses[5]["joined"]
    assert joined["replica"] == 1
    # The state it received is the donor's, bit for bit, before its first pass.
    assert joined["digests"] == joined["donor_digests"], joined
    # Its share of every later iteration: B over the 4 live replicas.
    assert joined["contributions"] == {str(t): B // REPLICAS for t in (7, 8)}, joined
    assert_exact_everywhere(run, reference, [0, 2, 3, 5])


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_straggler_evicted_is_replaced_by_a_standby(tmp_path, reference):
    """docs/stragglers.md: replica 2 takes 0.5 s longer per microbatch in iterations 2-3, past
    --recover-evict-slower-than 3 for the window of 2: it is evicted at iteration 3's commit
    and leaves after its step; standby rank 4 takes replica id 2 after iteration 3 (its speed
    history starts empty), and the run is the failure-free one."""
    schedule = """entries:
  - {iteration: 2, replica: 2, local_rank: 0, location: pre-forward, action: slow, seconds: 0.5,
     until: 3}
"""
    run = train(tmp_path, "evict", schedule, ["--recover-straggler-threshold", "0.5",
                                               "--recover-straggler-window", "2",
                                               "--recover-evict-slower-than", "3"])
    assert [(m["rank"], m["iteration"], m["action"]) for m in run.markers] == [(2, 2, "slow")]
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    assert_ledger_held(run.records, B)
    evicted = [(r["iteration"], e["evicted"]) for r in run.records for e in r["events"]
               if e["event"] == "straggler"]
    assert evicted == [(3, [2])], evicted
    assert run.records[2]["evicted"] == [2]
    assert joins(run) == [([2], [4], 3)]
    assert run.result.statuses[2]["state"] == "left", run.result.statuses[2]
    assert "evicted as stragglers" in run.result.output
    assert all(sorted(r["quotas"]) == ["0", "1", "2", "3"] for r in run.records[3:])
    assert_exact_everywhere(run, reference, [0, 1, 3, 4])


def events(run, kind: str) -> list[tuple]:
    return [(r["iteration"], e.get("replicas"), e.get("ranks")) for r in run.records
            for e in r["events"] if e["event"] == kind]


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_donor_dies_in_the_transfer_and_a_standby_dies_idle(tmp_path, reference):
    """Replica 1 dies in iteration 2; in the join after it the donor (rank 0, the lowest
    survivor) dies entering the state broadcast: the next survivor sends the state, standby
    rank 4 joins as replica 1, and replica 0's death is dropped from the layout there. Standby
    rank 5 died idle before the first call: the call's shrink leaves it out, and replica 0's id
    stays vacant (the pool is empty)."""
    schedule = """entries:
  - {iteration: 2, replica: 1, local_rank: 0, location: during-reduce}
  - {iteration: 2, replica: 0, local_rank: 0, location: join-transfer}
standbys:
  - {standby: 1, location: idle}
"""
    run = train(tmp_path, "donor", schedule)
    fired = sorted((m["rank"], m["location"]) for m in run.markers)
    assert fired == [(0, "join-transfer"), (1, "during-reduce"), (5, "idle")], fired
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    assert_ledger_held(run.records, B)
    assert joins(run) == [([1], [4], 2)]
    assert events(run, "failure") == [(2, [1], [1]), (3, [0], [0])]
    assert events(run, "join-abandoned") == []
    assert [r["live_replicas"] for r in run.records] == [4, 3] + [3] * (ITERATIONS - 2)
    joined = run.result.statuses[4]["joined"]
    assert joined["digests"] == joined["donor_digests"], joined
    assert_exact_everywhere(run, reference, [2, 3, 4])


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_joiner_dies_in_the_transfer(tmp_path, reference):
    """Standby rank 4, called for replica 1 after iteration 2, dies entering the state
    broadcast: that join ends with nobody new and no state lost; standby rank 5 is called after
    iteration 3 and joins."""
    schedule = """entries:
  - {iteration: 2, replica: 1, local_rank: 0, location: during-reduce}
standbys:
  - {standby: 0, location: join-transfer}
"""
    run = train(tmp_path, "joiner", schedule)
    fired = sorted((m["rank"], m["location"]) for m in run.markers)
    assert fired == [(1, "during-reduce"), (4, "join-transfer")], fired
    assert_ledger_held(run.records, B)
    assert [it for it, _, _ in events(run, "join-abandoned")] == [3]
    assert joins(run) == [([1], [5], 3)]
    assert [r["live_replicas"] for r in run.records] == [4, 3, 3] + [4] * (ITERATIONS - 3)
    joined = run.result.statuses[5]["joined"]
    assert joined["digests"] == joined["donor_digests"], joined
    assert_exact_everywhere(run, reference, [0, 2, 3, 5])


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_standbys_leave_when_every_training_replica_dies(tmp_path):
    """All four training replicas die in iteration 3: nobody is left to call the standbys, and
    they leave on their own (the job ends instead of waiting for a call forever)."""
    schedule = "entries:\n" + "".join(
        f"  - {{iteration: 3, replica: {r}, local_rank: 0, location: pre-forward}}\n"
        for r in range(REPLICAS))
    run_dir = tmp_path / "all"
    run_dir.mkdir()
    (run_dir / "schedule.yaml").write_text(schedule)
    result = launch(LaunchConfig(REPLICAS + STANDBYS, [
        *ENTRY, *MODEL, "--recover", "--recover-log", str(run_dir / "log.jsonl"),
        "--recover-failure-schedule", str(run_dir / "schedule.yaml")], run_dir / "status",
        TIMEOUT_S))
    assert not result.timed_out, result.output[-4000:]
    markers = read_markers(run_dir / "log.markers.jsonl")
    assert sorted(m["rank"] for m in markers) == list(range(REPLICAS))
    for rank in STANDBY_RANKS:
        status = result.statuses[rank]
        assert status["state"] == "completed" and status["standby"] == "idle", status
        assert status["reason"] == "every process that could call it is gone", status


TP2 = [*MODEL[:-2], "--tensor-model-parallel-size", "2"]  # MODEL without its standbys
HSDP = [*MODEL[:-2], "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
REPLACED = """entries:
  - {iteration: 2, replica: 0, local_rank: 0, location: during-reduce}
"""


def replace_replica_0(tmp_path, args: list[str], share: int):
    """2 replicas of 2 ranks (world ranks 0, 1 and 2, 3) and one standby replica of 2 ranks
    (4, 5). Replica 0 loses its rank 0 inside a bucket's all-reduce in iteration 2 and its rank
    1 leaves through the replica gate; the standby takes replica id 0 at both positions, each
    of its ranks from the survivor at its position (ranks 2, 3). Checks the join and that the
    run equals the failure-free one without standbys (losses; every position's parameters);
    `share`: the microbatch ids each rank of a replica contributes per iteration. Returns the
    run."""
    reference = run_training(tmp_path / "reference", 4, args, None, TIMEOUT_S)
    run = run_training(tmp_path / "grown", 6, [*args, "--recover-standby-replicas", "1"],
                       REPLACED, TIMEOUT_S)
    assert [(m["rank"], m["location"]) for m in run.markers] == [(0, "during-reduce")]
    assert run.result.statuses[1]["state"] == "left", run.result.statuses[1]
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    assert_ledger_held(run.records, B)
    assert [r["live_replicas"] for r in run.records] == [2, 1] + [2] * (ITERATIONS - 2)
    assert joins(run) == [([0], [4], 2)]  # as the writer (rank 2, position 0) logs it
    for rank, donor in ((4, 2), (5, 3)):  # position 0 and 1 of the joined replica
        joined = run.result.statuses[rank]["joined"]
        assert joined["replica"] == 0 and joined["ranks"] == [rank], joined
        # The state it received is its donor's, bit for bit, before its first pass.
        assert joined["digests"] == joined["donor_digests"], joined
        assert joined["contributions"] == {str(t): share for t in range(3, ITERATIONS + 1)}
        # Position by position, the joiner ends with the survivor's and the reference's state.
        assert run.result.statuses[rank]["param_digest"] == run.result.statuses[donor][
            "param_digest"]
        assert param_rdiff(run.params(rank), reference.params(rank - 4)) <= EXACT_PARAM_RTOL
    loss = loss_rdiff(run.records, reference.records)
    assert loss <= EXACT_LOSS_RTOL, loss
    return run


@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_standby_replaces_a_tensor_parallel_replica(tmp_path):
    """TP=2: each standby rank receives its own tensor-parallel shard."""
    run = replace_replica_0(tmp_path, TP2, B // 2)
    assert run.result.statuses[2]["param_digest"] != run.result.statuses[3]["param_digest"]


@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_standby_replaces_a_distributed_optimizer_instance(tmp_path):
    """2 distributed-optimizer instances of 2 shards: each standby rank receives the optimizer
    shard (main parameters, Adam moments) of the survivor at its shard position, and runs
    B / (2 instances x 2 shards) ids of every later iteration."""
    run = replace_replica_0(tmp_path, HSDP, B // 4)
    digests = [run.result.statuses[r]["joined"]["digests"]["optimizer"] for r in (4, 5)]
    assert digests[0] != digests[1]  # each shard's own state


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_join_carries_a_state_above_1_gib(tmp_path):
    """A position's state above 1 GiB (113 M parameters with Adam: 12 bytes each) reaches a
    standby: replica 1 of 2 dies in iteration 1, standby rank 2 joins after it, tensor by tensor
    in 64 MiB packs (one MPI call moves at most 1 GiB), and holds its donor's state bitwise."""
    model = ["--num-layers", "4", "--hidden-size", "1536", "--num-attention-heads", "12",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
             "--global-batch-size", "2", "--train-iters", "3", *STABLE_LR, "--eval-iters", "0",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
             "--log-interval", "1", "--recover-standby-replicas", "1"]
    schedule = "entries:\n  - {iteration: 1, replica: 1, local_rank: 0, location: during-reduce}\n"
    run = run_training(tmp_path / "big", 3, model, schedule, 2 * TIMEOUT_S - 60)
    assert [(m["rank"], m["location"]) for m in run.markers] == [(1, "during-reduce")]
    assert [r["iteration"] for r in run.records] == [1, 2, 3]
    assert_ledger_held(run.records, 2)
    assert joins(run) == [([1], [2], 1)]
    joined = run.result.statuses[2]["joined"]
    assert joined["state_bytes"] > 1 << 30, joined["state_bytes"]
    assert joined["digests"] == joined["donor_digests"], joined
    seconds = joined["state_received"] - joined["called"]
    print(f"join of {joined['state_bytes'] / 2**30:.2f} GiB per position: {seconds:.1f} s "
          "from the call to the state received")
    digests = {r: run.result.statuses[r]["param_digest"] for r in (0, 2)}
    assert len(set(digests.values())) == 1, digests
