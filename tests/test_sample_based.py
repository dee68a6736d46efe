"""Sample-based training (--train-samples, --lr-decay-samples, --lr-warmup-samples) under --recover.

Run: `make test`. CPU only; 4 oversubscribed ranks per run, each under a hard timeout.
- The same schedule written in samples trains bitwise like the iteration-based run.
- With a training split that is not a whole number of global batches (as Megatron-LM builds it
  from --train-samples), a run that loses replicas equals its failure-free run.
"""

import pytest

from tests.training_harness import STABLE_LR, assert_exact, assert_ledger_held, run_training

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
TIMEOUT_S = 240
GBS = 8
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--eval-iters", "0",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", str(GBS), *STABLE_LR, "--lr-decay-style", "cosine",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--log-interval", "1",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
ITERATION_BASED = ["--train-iters", "6", "--lr-decay-iters", "5", "--lr-warmup-iters", "1"]
SAMPLE_BASED = ["--train-samples", "48", "--lr-decay-samples", "40", "--lr-warmup-samples", "8"]
SCHEDULE = """entries:
  - {iteration: 2, replica: 1, local_rank: 0, location: during-reduce}
  - {iteration: 4, replica: 3, local_rank: 0, location: backward}
"""


def train(tmp_path, name, schedule_args, schedule=None):
    return run_training(tmp_path / name, 4, [*MODEL, *schedule_args], schedule, TIMEOUT_S)


@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_schedule_in_samples_equals_schedule_in_iterations(tmp_path):
    by_iterations = train(tmp_path, "iterations", ITERATION_BASED)
    by_samples = train(tmp_path, "samples", SAMPLE_BASED)
    assert [r["lr"] for r in by_samples.records] == [r["lr"] for r in by_iterations.records]
    assert [r["loss"] for r in by_samples.records] == [r["loss"] for r in by_iterations.records]
    statuses = (by_samples.result.statuses, by_iterations.result.statuses)
    assert statuses[0][0]["param_digest"] == statuses[1][0]["param_digest"]


@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_sample_based_run_with_failures_is_exact(tmp_path):
    # 53 samples: 6 whole global batches of 8 (Megatron-LM's update_train_iters) from a training
    # split of 53 samples, as Megatron-LM builds it.
    schedule_args = ["--train-samples", "53", "--lr-decay-samples", "40", "--lr-warmup-samples",
                     "8"]
    reference = train(tmp_path, "reference", schedule_args)
    run = train(tmp_path, "failures", schedule_args, SCHEDULE)
    assert [r["iteration"] for r in run.records] == list(range(1, 7))
    assert sorted((m["rank"], m["location"]) for m in run.markers) == [
        (1, "during-reduce"), (3, "backward")]
    assert [r["live_replicas"] for r in run.records] == [4, 3, 3, 2, 2, 2]
    assert_ledger_held(run.records, GBS)
    assert_exact(run, reference, "sample-based, two failures")
