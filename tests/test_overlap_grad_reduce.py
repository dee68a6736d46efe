"""--overlap-grad-reduce under --recover: bucket reductions posted during backward.

Run: `make test`. CPU only, 4 oversubscribed ranks per run, each under a hard timeout.

Overlapped, layer 2 posts a bucket as soon as megatron-core reports it complete in the last
microbatch's backward; the failure schedule's `during-reduce` then kills the victim inside the
first bucket it posted, and its marker records what the main thread was doing ("schedule":
megatron's forward/backward was still running). The victim also stalls (computes, without
communication) right after that post, inside backward: on two oversubscribed cores the ulfm
worker thread may otherwise get the CPU only after the victim's short backward has ended, and
the kill would land after the schedule. Every layout is checked two ways:
  - failure-free, overlapped and deferred runs end with bitwise-equal parameters (a bucket
    posted before its gradients were complete, or before megatron's in-replica syncs, would
    change them);
  - with the kill, loss and parameters equal the failure-free run, the ledger invariant holds
    and the survivors agree bitwise.
Layouts: data parallelism (4 replicas); PP=2 with tied embeddings (the embedding's bucket is
synced between the stages after backward, so it is posted after the schedule); two
distributed-optimizer instances of 2 shards (the reduce-scatter is chained before the all-reduce
on a helper thread).
"""

import pytest

from tests.training_harness import (
    STABLE_LR,
    assert_exact,
    assert_ledger_held,
    run_training,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
TIMEOUT_S = 240
ITERATIONS = 4
GBS = 8
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--eval-iters", "0",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", str(GBS), "--train-iters", str(ITERATIONS), *STABLE_LR,
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--ddp-bucket-size", "2000", "--log-interval", "1",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
OVERLAP = ["--overlap-grad-reduce"]
# layout: (arguments, victim's (replica, local rank), the ranks that complete after the kill,
# the replicas left, how many different parameter digests the survivors hold: one per stage)
POST_STALL_S = 0.3
LAYOUTS = {
    "dp4": ([], (1, 0), [0, 2, 3], 3, 1),
    # Replica 1 is world ranks 1 (stage 0) and 3 (stage 1). Megatron-core gives a stage after
    # the first one bucket, here holding the output layer's tied weight: it is posted after the
    # schedule. Stage 0's embedding bucket too; its other buckets go out during backward.
    "pp2-tied": (["--pipeline-model-parallel-size", "2"], (1, 0), [0, 2], 1, 2),
    # Instance 1 is world ranks 2, 3; shard 1 (rank 3) dies. Both shards hold the whole model.
    # Its first all-reduce goes out at megatron's second report, after the first bucket's
    # reduce-scatter with shard 0.
    "do2x2": (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
              (1, 1), [0, 1], 1, 1),
}


def train(tmp_path, name, args, schedule=None):
    run = run_training(tmp_path / name, 4, [*MODEL, *args], schedule, TIMEOUT_S)
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    return run


def digests(run):
    return {rank: run.result.statuses[rank]["param_digest"] for rank in run.completed()}


@pytest.mark.timeout(4 * TIMEOUT_S)
# `make test-long`: `make test` keeps the deferred kill below, and the unit tier posts buckets in
# overlapped order (tests/unit/test_protocol.py).
@pytest.mark.long
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kill_while_reductions_overlap_backward(tmp_path, layout):
    args, (replica, local_rank), survivors, live, stages = LAYOUTS[layout]
    deferred = train(tmp_path, "deferred", args)
    reference = train(tmp_path, "overlapped", [*args, *OVERLAP])
    assert digests(reference) == digests(deferred), "overlap changed the reduced gradients"
    assert [r["loss"] for r in reference.records] == [r["loss"] for r in deferred.records]
    # Iteration 3: megatron-core learns each bucket's gradient hooks in iteration 1 and reports
    # complete buckets from iteration 2 on.
    victim = f"iteration: 3, replica: {replica}, local_rank: {local_rank}"
    schedule = (f"entries:\n  - {{{victim}, location: during-reduce}}\n"
                f"  - {{{victim}, location: after-post, action: stall, "
                f"seconds: {POST_STALL_S}}}\n")
    run = train(tmp_path, "kill", [*args, *OVERLAP], schedule)
    (marker,) = [m for m in run.markers if m["location"] == "during-reduce"]
    assert marker["iteration"] == 3
    assert marker["phase"] == "schedule", marker  # backward was still running
    assert run.completed() == survivors
    assert_ledger_held(run.records, GBS)
    assert run.records[-1]["live_replicas"] == live
    assert_exact(run, reference, f"{layout}: kill inside a reduction posted during backward")
    assert len(set(digests(run).values())) == stages  # survivors of a position agree bitwise


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_deferred_kill_is_after_the_schedule(tmp_path):
    # The control for the marker: without the flag the same kill lands after the schedule.
    args, (replica, local_rank), survivors, _, _ = LAYOUTS["dp4"]
    victim = f"iteration: 3, replica: {replica}, local_rank: {local_rank}"
    schedule = (f"entries:\n  - {{{victim}, location: during-reduce}}\n"
                f"  - {{{victim}, location: after-post, action: stall, "
                f"seconds: {POST_STALL_S}}}\n")
    run = train(tmp_path, "kill", args, schedule)
    (marker,) = [m for m in run.markers if m["location"] == "during-reduce"]
    assert marker["phase"] == "after-schedule", marker
    assert run.completed() == survivors
    assert_ledger_held(run.records, GBS)
