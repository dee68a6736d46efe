"""Batch-size schedules (--step-batch-size-schedule) with sample-based training, end to end.

Run: `make test`. CPU only; three 4-rank runs, each under a hard timeout (about a minute here).
The schedule "0:4 261:8 0.52K:12 896:16" (thresholds in tokens of --seq-length 32: samples 0, 8,
16 and 28) takes the global batch 4 -> 4 -> 8 -> 12 -> 16 samples (megatron-core 0.19's
StepBatchsizeNumMicroBatchesCalculator says so; the test asks it), and --train-samples 50 ends
inside the last iteration, which Megatron-LM core_v0.19.0's update_train_iters runs whole.
Replica 1 dies inside a bucket all-reduce of iteration 3, the first step up, and replica 3 in the
backward of iteration 5, the step to the full batch, so the survivors re-lay out for a new B twice
with fewer replicas. The failure run must commit each iteration's own B (the ledger, checked
against megatron-core's calculator and the dataset) and equal the failure-free run; that run must
equal stock Megatron (no --recover, megatron-core's own calculator installed as Megatron-LM's
set_global_variables does).
"""

import json
import re

import pytest
import torch

from megatron_recover.launch import LaunchConfig, launch
from megatron_recover.testing.compare import param_rdiff
from tests.mpirun_harness import ENTRY
from tests.policy.test_rampup import megatron_batches
from tests.training_harness import (
    EXACT_RTOL,
    STABLE_LR,
    assert_exact,
    loss_rdiff,
    megatron_lm_lines,
    printed_values,
    run_training,
)

TIMEOUT_S = 240
SEQ, SCHEDULE_TEXT, TRAIN_SAMPLES = 32, "0:4 261:8 0.52K:12 896:16", 50
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--eval-iters", "0",
       "--seq-length", str(SEQ), "--max-position-embeddings", "32", "--micro-batch-size", "1",
       "--step-batch-size-schedule", SCHEDULE_TEXT,
       "--lr-decay-samples", "48",
       "--lr-warmup-samples", "8", *STABLE_LR, "--lr-decay-style", "cosine",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--ddp-bucket-size", "2000", "--log-interval", "1",
       # No dropout: stock Megatron draws it in sequence, exact mode by microbatch id.
       "--hidden-dropout", "0", "--attention-dropout", "0"]
WHOLE_RUN = ["--train-samples", str(TRAIN_SAMPLES)]
RAMP_STEP_FAILURE = "  - {iteration: 3, replica: 1, local_rank: 0, location: during-reduce}\n"
FULL_BATCH_FAILURE = "  - {iteration: 5, replica: 3, local_rank: 0, location: backward}\n"
SCHEDULE = "entries:\n" + RAMP_STEP_FAILURE + FULL_BATCH_FAILURE


def expected_batches(train_samples: int = TRAIN_SAMPLES) -> list[tuple[int, int]]:
    """(first sample, size) of each iteration Megatron-LM trains: megatron-core's calculator,
    and update_train_iters' count (every iteration that starts before --train-samples are
    consumed)."""
    batches = megatron_batches(SCHEDULE_TEXT, SEQ, iterations=20)
    return [b for b in batches if b[0] < train_samples]


def printed(output: str, field: str) -> list[int]:
    return [int(v) for v in re.findall(rf"{field}:\s+(\d+)", output)]


@pytest.mark.timeout(60)
def test_megatron_cores_calculator_answers_from_the_policy_under_recover():
    """What megatron code asking get_num_microbatches() gets once the resilient trainer is set
    up: this rank's share of the iteration's B, following the schedule's steps."""
    from types import SimpleNamespace

    from megatron.core import num_microbatches_calculator as megatron_calculator

    from megatron_recover.megatron.app.run import _install_calculator
    from megatron_recover.policy import PolicyConfig, WorkloadPolicy

    policy = WorkloadPolicy(PolicyConfig(2, 4, ramp=(2, 4)))
    trainer = SimpleNamespace(shard=(1, 2), p=SimpleNamespace(policy=policy, replica=1))
    _install_calculator(SimpleNamespace(micro_batch_size=3), trainer)
    try:
        seen = []
        for iteration in (1, 2, 3):
            seen.append((megatron_calculator.get_num_microbatches(),
                         megatron_calculator.get_current_global_batch_size()))
            policy.begin(iteration)
            policy.commit()
        # B = 2, 4, 8 over two replicas of two shards: replica 1 runs 1, 2, 4 ids; shard 1 of
        # them every second one from the second.
        assert seen == [(0, 6), (1, 12), (2, 24)]
    finally:
        megatron_calculator.unset_num_microbatches_calculator()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The failure-free scheduled run under --recover."""
    return run_training(tmp_path_factory.mktemp("schedule") / "reference", 4, [*JOB, *WHOLE_RUN],
                        timeout_s=TIMEOUT_S)


@pytest.mark.long
@pytest.mark.mpi
@pytest.mark.e2e
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_schedule_with_failures_in_its_steps_is_exact(tmp_path, reference, figures):
    batches = expected_batches()
    sizes = [size for _, size in batches]
    assert sizes == [4, 4, 8, 12, 16, 16]  # what the schedule above is meant to exercise
    assert sum(sizes) > TRAIN_SAMPLES  # the last iteration runs past --train-samples

    stock = launch(LaunchConfig(4, [*ENTRY, *JOB, *WHOLE_RUN], tmp_path / "stock",
                                timeout_s=TIMEOUT_S))
    assert stock.succeeded, stock.output[-4000:]
    assert printed(stock.output, "global batch size") == sizes
    assert printed(stock.output, "consumed samples") == [sum(b) for b in batches]

    assert [r["B"] for r in reference.records] == sizes  # micro-batch size 1: B_t = GBS_t
    assert printed(reference.result.output, "global batch size") == sizes
    assert printed(reference.result.output, "consumed samples") == [sum(b) for b in batches]
    stock_losses = printed_values(stock.output, "lm loss")
    expected = megatron_lm_lines({r["iteration"]: r["loss"] for r in reference.records})
    loss = max(abs(e - s) / abs(s) for e, s in zip(expected.values(), stock_losses))
    params = param_rdiff(reference.params(0), torch.load(tmp_path / "stock/rank-0.params.pt"))
    figures.append(f"batch-size schedule, --recover failure-free vs stock Megatron: loss "
                   f"{loss:.2e}, "
                   f"parameters {params:.2e}")
    assert len(stock_losses) == len(sizes) and loss <= EXACT_RTOL and params <= EXACT_RTOL

    run = run_training(tmp_path / "failures", 4, [*JOB, *WHOLE_RUN], SCHEDULE, TIMEOUT_S)
    assert sorted((m["rank"], m["location"], m["iteration"]) for m in run.markers) == [
        (1, "during-reduce", 3), (3, "backward", 5)]
    assert [r["live_replicas"] for r in run.records] == [4, 4, 3, 3, 2, 2]
    bad = [(r["iteration"], r["contributions"], r["ledger_problems"]) for r in run.records
           if not (r["invariant_ok"] and r["contributions"] == r["B"])]
    assert not bad, f"ledger invariant violated: {bad}"
    assert [r["B"] for r in run.records] == sizes
    assert [r["lr"] for r in run.records] == [r["lr"] for r in reference.records]
    loss, params = assert_exact(run, reference, "batch-size schedule, two failures in its steps")
    figures.append(f"batch-size schedule, two failures in its steps vs failure-free: loss "
                   f"{loss:.2e}, parameters {params:.2e}")


@pytest.mark.long
@pytest.mark.mpi
@pytest.mark.e2e
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_schedule_resumes_from_a_checkpoint_written_after_a_failure(tmp_path, reference,
                                                                    figures):
    """A first launch trains the steps before the last (their 28 samples) and loses replica 1
    in the first step up; the checkpoint it writes at the end resumes on two replicas with the
    whole --train-samples (a resumed job's sizes must divide by its data-parallel size, as at any
    start), and the first iteration after it lays them out for the full B."""
    ramp_samples = sum(size for _, size in expected_batches()[:4])
    assert len(expected_batches(ramp_samples)) == 4
    ckpt = tmp_path / "ckpt"
    first = run_training(tmp_path / "first", 4, [
        *JOB, "--train-samples", str(ramp_samples), "--save", str(ckpt), "--save-interval",
        "100"], "entries:\n" + RAMP_STEP_FAILURE, TIMEOUT_S)
    assert [(m["rank"], m["iteration"]) for m in first.markers] == [(1, 3)]
    assert [r["B"] for r in first.records] == [4, 4, 8, 12]
    state = json.loads((ckpt / "iter_0000004/recover_state.json").read_text())
    assert state["live_replicas"] == [0, 2, 3] and state["ramp"] == [4, 4, 8, 12]
    # A longer run than the checkpoint's changes the scheduler's weight-decay horizon (its
    # --train-samples): as in Megatron-LM, the load then needs the arguments to win.
    resumed = run_training(tmp_path / "resumed", 2, [*JOB, *WHOLE_RUN, "--load", str(ckpt),
                                                     "--override-opt-param-scheduler"],
                           timeout_s=TIMEOUT_S)
    assert "resumed iteration 4" in resumed.result.output
    assert [(r["iteration"], r["B"], r["live_replicas"]) for r in resumed.records] == [
        (5, 16, 2), (6, 16, 2)]
    assert all(r["invariant_ok"] and r["contributions"] == 16 for r in resumed.records)
    loss = loss_rdiff(resumed.records, reference.records[4:])
    params = max(param_rdiff(resumed.params(r), reference.params(0)) for r in range(2))
    figures.append(f"batch-size schedule, resumed on 2 replicas after its steps up: loss "
                   f"{loss:.2e}, parameters {params:.2e}")
    assert loss <= EXACT_RTOL and params <= EXACT_RTOL
