"""Megatron's HSDP form: a replica is a distributed-optimizer instance whose shards reduce-scatter
each bucket in place before the ulfm all-reduce across instances. Every recovery path must start
again from the bucket as it was before the reduce-scatter, or a shard is counted twice.

Run: `make test`. CPU only, oversubscribed ranks under a hard timeout, 2 shards per instance,
dropout on (exact mode reseeds it per microbatch id, so the failure-free curve does not depend on
how many instances run it):
  - 2 instances, a rank killed inside a bucket all-reduce: the other instance runs the lost
    microbatches in an extension pass that accumulates into the same buffer;
  - 3 instances, a second rank killed inside that extension pass;
  - the blocking path (rewind and reduce again, here the adaptive policy's drop) must give what
    the same failure gives without a distributed optimizer;
  - --use-distributed-optimizer alone under --recover: one instance per replica, a failure;
  - --overlap-param-gather, 3 instances x 2 shards: an extension pass of one microbatch per
    instance leaves a shard without microbatches (its forward pre-hooks never fire), and a rank
    dies entering the parameter all-gather its peer waits for in its next forward; and without
    --recover, megatron's own overlapped all-gather gives the same parameters, bitwise.
"""

import pytest

from megatron_recover.launch import LaunchConfig, launch
from tests.mpirun_harness import ENTRY
from tests.training_harness import (
    EXACT_LOSS_RTOL,
    STABLE_LR,
    assert_exact,
    assert_ledger_held,
    loss_rdiff,
    run_training,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
TIMEOUT_S = 300
ITERATIONS = 5
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--eval-iters", "0",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", "12", "--train-iters", str(ITERATIONS), *STABLE_LR,
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--log-interval", "1"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def hsdp(instances):
    return ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", str(instances)]


def train(tmp_path, name, num_ranks, extra, schedule=None):
    run = run_training(tmp_path / name, num_ranks, [*MODEL, *extra], schedule, TIMEOUT_S)
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    return run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """2 instances x 2 shards, failure-free."""
    return train(tmp_path_factory.mktemp("hsdp"), "reference", 4, [*hsdp(2), *DROPOUT])


def failure_events(records):
    return [e for r in records for e in r["events"] if e["event"] == "failure"]


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_kill_inside_reduce_extension_pass(tmp_path, reference):
    # World ranks 2, 3 are instance 1; local rank 1 (rank 3) dies inside a bucket all-reduce.
    schedule = ("entries:\n"
                "  - {iteration: 3, replica: 1, local_rank: 1, location: during-reduce}\n")
    run = train(tmp_path, "reduce", 4, [*hsdp(2), *DROPOUT], schedule)
    result, records = run.result, run.records
    assert [(m["rank"], m["location"]) for m in run.markers] == [(3, "during-reduce")]
    assert result.statuses[2]["state"] == "left", result.statuses[2]
    assert all(result.statuses[r]["state"] == "completed" for r in (0, 1))
    assert_ledger_held(records, 12)
    (event,) = failure_events(records)
    assert event["replicas"] == [1] and event["g_ext"] > 0  # a boundary: the extension path
    assert_exact(run, reference, "HSDP 2x2, kill inside reduce")


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_kill_inside_extension_pass(tmp_path, reference):
    # 3 instances x 2 shards: instance 2 dies inside a reduce, then instance 1 inside the
    # extension pass that recomputes instance 2's microbatches; instance 0 finishes alone.
    schedule = ("entries:\n"
                "  - {iteration: 3, replica: 2, local_rank: 0, location: during-reduce}\n"
                "  - {iteration: 3, replica: 1, local_rank: 1, location: during-extension}\n")
    run = train(tmp_path, "extension", 6, [*hsdp(3), *DROPOUT], schedule)
    result, records = run.result, run.records
    fired = sorted((m["rank"], m["location"]) for m in run.markers)
    assert fired == [(3, "during-extension"), (4, "during-reduce")]
    assert all(result.statuses[r]["state"] == "completed" for r in (0, 1))
    assert_ledger_held(records, 12)
    assert sorted(r for e in failure_events(records) for r in e["replicas"]) == [1, 2]
    assert records[-1]["live_replicas"] == 1
    # Ranks 0, 1 hold instance 0 in both runs (the reference has 2 instances, this run 3).
    assert_exact(run, reference, "HSDP 3x2, kill inside the extension pass")


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_distributed_optimizer_alone_is_one_instance_per_replica(tmp_path, reference):
    # --use-distributed-optimizer without instances under --recover: three replicas of one rank,
    # each its own instance (optimizer state replicated); replica 2 dies inside a reduce.
    schedule = ("entries:\n"
                "  - {iteration: 3, replica: 2, local_rank: 0, location: during-reduce}\n")
    run = train(tmp_path, "alone", 3, ["--use-distributed-optimizer", *DROPOUT], schedule)
    assert "one optimizer instance per replica (--num-distributed-optimizer-instances 3)" in (
        run.result.output)
    assert [(m["rank"], m["location"]) for m in run.markers] == [(2, "during-reduce")]
    assert [r["live_replicas"] for r in run.records] == [3, 3, 2, 2, 2]
    assert_ledger_held(run.records, 12)
    # Every rank holds the whole model: ranks 0 and 1 compare with the same ranks of 2 x 2.
    assert_exact(run, reference, "distributed optimizer alone, 3 replicas, kill inside reduce")


@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_blocking_restore_matches_plain_data_parallel(tmp_path):
    # The adaptive policy drops instance 1's microbatches: rewind every bucket to its
    # pre-reduce-scatter snapshot and reduce again. Without dropout the sharded run must give the
    # plain data-parallel run's losses under the same failure.
    adaptive = ["--recover-policy", "adaptive", *NO_DROPOUT]
    schedule = ("entries:\n"
                "  - {iteration: 3, replica: 1, local_rank: 0, location: during-reduce}\n")
    sharded = train(tmp_path, "sharded", 4, [*hsdp(2), *adaptive], schedule).records
    plain = train(tmp_path, "plain", 2, adaptive, schedule).records
    (event,) = failure_events(sharded)
    assert event["restore"] == "blocking", event
    assert [r["contributions"] for r in sharded] == [r["contributions"] for r in plain]
    assert sharded[2]["contributions"] == 6  # instance 1's six microbatches were dropped
    assert all(r["invariant_ok"] for r in sharded + plain)
    diff = loss_rdiff(sharded, plain)
    print(f"HSDP 2x2 vs plain DP=2, adaptive drop: max relative loss diff {diff:.2e}")
    assert diff <= EXACT_LOSS_RTOL


@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_overlap_param_gather_with_an_idle_shard_and_a_failure(tmp_path):
    # GBS 6 over 3 instances: one microbatch per shard. Iteration 3: instance 2 dies inside a
    # reduce; its 2 microbatches go one to each surviving instance, so shard 1 of each runs none
    # in the extension pass. Iteration 4: rank 3 (instance 1, shard 1) dies after the step,
    # entering the all-gather that rank 2 waits for in iteration 5's forward.
    small = ["--global-batch-size", "6", *NO_DROPOUT]
    schedule = ("entries:\n"
                "  - {iteration: 3, replica: 2, local_rank: 0, location: during-reduce}\n"
                "  - {iteration: 4, replica: 1, local_rank: 1, location: param-gather}\n")
    reference = train(tmp_path, "plain", 6, [*hsdp(3), *small])
    run = train(tmp_path, "overlap", 6, [*hsdp(3), *small, "--overlap-param-gather"], schedule)
    result, records = run.result, run.records
    assert sorted((m["rank"], m["location"]) for m in run.markers) == [
        (3, "param-gather"), (4, "during-reduce")]
    (first, second) = failure_events(records)
    assert first["replicas"] == [2] and first["g_ext"] == 1, first  # one id per instance
    assert second["replicas"] == [1], second
    # Rank 2 leaves with its instance; if its status says otherwise, the output says how it ended.
    assert result.statuses[2]["state"] == "left", (result.statuses[2], result.output[-6000:])
    assert run.completed() == [0, 1]
    assert_ledger_held(records, 6)
    assert [r["live_replicas"] for r in records] == [3, 3, 2, 2, 1]
    # Both shards of instance 0 end with the same, fully gathered parameters.
    assert result.statuses[0]["param_digest"] == result.statuses[1]["param_digest"]
    assert_exact(run, reference, "HSDP 3x2 --overlap-param-gather, idle shard and failures")


@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_stock_overlap_param_gather_gives_the_same_parameters(tmp_path):
    # Megatron's path: the last step's parameters reach the other shards only in a next forward,
    # so the end of training gathers them (as Megatron-LM does before a save and at the end).
    job = [*ENTRY, *MODEL, "--use-distributed-optimizer", *NO_DROPOUT]
    digests = {}
    for name, extra in (("plain", []), ("overlap", ["--overlap-param-gather"])):
        result = launch(LaunchConfig(4, [*job, *extra], tmp_path / name, TIMEOUT_S))
        assert not result.timed_out and result.succeeded, result.output[-4000:]
        digests[name] = {s["param_digest"] for s in result.statuses.values()}
    print(f"stock DO x4, parameter digests: {digests}")
    assert len(digests["plain"]) == 1 and digests["overlap"] == digests["plain"]
