"""End-to-end: evaluation, Megatron's iteration line, TensorBoard and the --exit-* flags while
replicas die.

- Global rank 0 (replica 0, the writer) dies inside the evaluation after iteration 2, another
  replica in iteration 5's backward: training goes on, every validation value equals the
  failure-free run's (the first bitwise: the parameters are still the same), and TensorBoard's
  own reader finds Megatron's tags and ours with one value per logged iteration, the ones after
  the writer died written by the rank that took over (a second event file).
- --exit-interval stops every survivor after the same iteration with a checkpoint, and a
  relaunch resumes from it; --exit-signal-handler turns a signal sent to one rank into the same
  stop on every rank (the request rides in the commit lane); --exit-duration-in-mins stops a
  stock run the same way (an all-reduce of the request).
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_recover.launch import LaunchConfig, launch
from tests.mpirun_harness import ENTRY
from tests.training_harness import EXACT_RTOL, STABLE_LR, run_training

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
REPLICAS = 4
ITERATIONS = 7
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", "8", *STABLE_LR,
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--ddp-bucket-size", "2000", "--log-interval", "1"]
EVALUATED = ["--train-iters", str(ITERATIONS), "--eval-interval", "2", "--eval-iters", "2",
             "--log-validation-ppl-to-tensorboard", "--log-throughput"]
SCHEDULE = """entries:
  - {iteration: 2, replica: 0, local_rank: 0, location: evaluation}
  - {iteration: 5, replica: 2, local_rank: 0, location: backward}
"""
# Evaluations after iterations 2, 4 and 6, and the end-of-training one after 7.
EVALUATION_STEPS = [2, 4, 6, 7]
TRAINING_TAGS = ["learning-rate", "batch-size", "lm loss", "loss-scale", "grad-norm"]
OUR_TAGS = ["live replicas", "failures", "recovery seconds"]
VALIDATION_TAGS = ["lm loss validation", "lm loss validation ppl"]
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+)( on validation set)? \| "
                             r"lm loss value: (\S+) \| lm loss PPL: (\S+) \|")


def scalars(directory):
    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def validation_losses(output: str) -> dict[int, float]:
    """The validation split's losses by iteration, from Megatron's lines (not the test set)."""
    return {int(m.group(1)): float(m.group(3)) for m in VALIDATION_LINE.finditer(output)}


def reference(tmp_path, params, args, which) -> dict:
    """tests/_eval_reference.py on `params` (none of megatron_recover's evaluation, schedule or
    data addressing): `which` is an evaluation of the validation split or `train:T`."""
    (tmp_path / "args.json").write_text(json.dumps(args))
    out = tmp_path / f"plain-{params.parent.parent.name}.json"
    subprocess.run([sys.executable, str(ROOT / "tests/_eval_reference.py"), str(params),
                    str(tmp_path / "args.json"), which, str(out)],
                   check=True, timeout=TIMEOUT_S)
    return json.loads(out.read_text())


def plain_loss(tmp_path, params) -> float:
    """The end-of-training validation loss of `params`."""
    plain = reference(tmp_path, params, [*MODEL, *EVALUATED], str(ITERATIONS // 2 + 1))
    assert plain["tokens"] == 2 * 8 * 32  # eval_iters x GBS samples of seq-length tokens
    return plain["loss"]


# make test's budget: in make test-long; in process, testing/invariants.py checks every logged
# loss against the committed microbatches' loss sum over their tokens.
@pytest.mark.long
def test_logged_training_loss_is_the_loss_sum_over_the_loss_tokens(tmp_path):
    """As Megatron-LM logs it, with or without --recover: with --eod-mask-loss the microbatches
    mask different token counts, so the mean of the microbatches' means is another value (the
    reference computes both and the test checks that they are told apart). --lr 0 keeps
    iteration 1's parameters for the reference, and no dropout keeps its forward plain. The
    stock run's line comes from Megatron-LM's first-iteration line (--log-interval 5 would
    print none in a one-iteration run)."""
    # megatron's mock documents count up modulo the vocabulary, so end-of-document (the last id
    # since megatron-core 0.19) comes every --vocab-size tokens: with 13, a sample of 32 tokens
    # masks 2 or 3 (with 128, one of the 256 here was masked). A wide initialisation makes the
    # tokens' losses differ: near the uniform prediction every token's loss is log(V).
    args = [*MODEL, "--train-iters", "1", "--eval-iters", "0", "--eod-mask-loss", "--lr", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "5",
            "--vocab-size", "13", "--init-method-std", "1.0"]
    run = run_training(tmp_path / "recover", 2, args, timeout_s=TIMEOUT_S)
    stock = launch(LaunchConfig(2, [*ENTRY, *args], tmp_path / "stock" / "status", TIMEOUT_S))
    assert not stock.timed_out and stock.succeeded, stock.output[-4000:]
    stock_loss = float(re.search(r" iteration +1/ +1 \|.* lm loss: (\S+) \|", stock.output)[1])
    plain = reference(tmp_path, run.status_dir / "rank-0.params.pt", args, "train:1")
    assert plain["tokens"] < 8 * 32  # some end-of-document tokens were masked
    told_apart = abs(plain["mean of sample means"] - plain["loss"]) / plain["loss"]
    assert told_apart > 10 * EXACT_RTOL, plain
    assert run.records[0]["loss"] == pytest.approx(plain["loss"], rel=EXACT_RTOL), plain
    assert stock_loss == pytest.approx(plain["loss"], rel=EXACT_RTOL), (stock_loss, plain)


@pytest.mark.long
def test_stock_evaluation_equals_a_plain_forward(tmp_path):
    """Without --recover the data-parallel ranks split the microbatches (gloo all-reduce)."""
    result = launch(LaunchConfig(2, [*ENTRY, *MODEL, *EVALUATED], tmp_path / "stock" / "status",
                                 TIMEOUT_S))
    assert not result.timed_out and result.succeeded, result.output[-4000:]
    losses = validation_losses(result.output)
    assert sorted(losses) == EVALUATION_STEPS
    params = tmp_path / "stock" / "status" / "rank-0.params.pt"
    assert losses[ITERATIONS] == pytest.approx(plain_loss(tmp_path, params), rel=2e-6), losses


def evaluated_run(tmp_path, name, schedule=None):
    tb = tmp_path / name / "tb"
    run = run_training(tmp_path / name, REPLICAS,
                       [*MODEL, *EVALUATED, "--tensorboard-dir", str(tb)], schedule, TIMEOUT_S)
    return run, scalars(tb), tb


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_evaluation_and_tensorboard_survive_replica_and_writer_failures(tmp_path):
    reference, reference_tb, _ = evaluated_run(tmp_path, "reference")
    run, tb, tb_dir = evaluated_run(tmp_path, "faults", SCHEDULE)
    output = run.result.output

    # The faults fired where they were meant to: rank 0 inside the evaluation.
    assert sorted((m["rank"], m["iteration"], m["location"]) for m in run.markers) == [
        (0, 2, "evaluation"), (2, 5, "backward")]
    assert "replica(s) [0] lost (ranks [0]), epoch 1, during the evaluation" in output
    assert [r["live_replicas"] for r in run.records] == [4, 4, 3, 3, 2, 2, 2]
    assert all(r["invariant_ok"] and r["contributions"] == r["B"] == 8 for r in run.records)

    # Validation: every evaluation ran and equals the failure-free one; the evaluation the
    # writer died in is the failure-free value bitwise (float32 in TensorBoard, printed too).
    ours, theirs = validation_losses(output), validation_losses(reference.result.output)
    assert sorted(ours) == sorted(theirs) == EVALUATION_STEPS
    for step in EVALUATION_STEPS:
        assert abs(ours[step] - theirs[step]) <= EXACT_RTOL * abs(theirs[step]), (step, ours)
    assert tb["lm loss validation"][0] == reference_tb["lm loss validation"][0]
    assert "on test set" in output  # Megatron's end-of-training evaluation of the test split
    # The end-of-training value against a plain forward over Megatron's validation samples with
    # a survivor's final parameters.
    plain = plain_loss(tmp_path, run.status_dir / "rank-1.params.pt")
    assert ours[ITERATIONS] == pytest.approx(plain, rel=2e-6), (ours, plain)

    # TensorBoard: Megatron's tags and ours, one value per logged iteration, also after the
    # writer died; the rank that took over wrote its own event file.
    assert len(list(tb_dir.glob("events.out.tfevents.*"))) == 2
    listed = subprocess.run([sys.executable, str(ROOT / "scripts/tensorboard_tags.py"),
                             str(tb_dir)], check=True, capture_output=True, text=True,
                            timeout=120).stdout  # docs/running.md's way to look at them
    assert "2 event file(s)" in listed and re.search(r"lm loss validation +4 values", listed)
    iterations = list(range(1, ITERATIONS + 1))
    samples = [8 * i for i in iterations]
    for tag in TRAINING_TAGS:
        assert [step for step, _ in tb[tag]] == iterations, tag
        assert [step for step, _ in tb[f"{tag} vs samples"]] == samples, tag
    for tag in OUR_TAGS:
        assert [step for step, _ in tb[tag]] == iterations, tag
    for tag in VALIDATION_TAGS:
        assert [step for step, _ in tb[tag]] == EVALUATION_STEPS, tag
        assert [step for step, _ in tb[f"{tag} vs samples"]] == [8 * s for s in EVALUATION_STEPS]
    assert [value for _, value in tb["live replicas"]] == [4, 4, 3, 3, 2, 2, 2]
    assert [value for _, value in tb["failures"]] == [0, 0, 1, 1, 2, 2, 2]
    assert [value for _, value in tb["recovery seconds"]][4] > 0  # iteration 5 recovered
    # The values are the agreed ones: the logged losses, the printed validation losses.
    for (step, value), record in zip(tb["lm loss"], run.records):
        assert value == pytest.approx(record["loss"], rel=1e-6), step
    for step, value in tb["lm loss validation"]:
        assert value == pytest.approx(ours[step], rel=1e-6), step

    # Megatron's iteration line, with ours; TFLOP/s per rank with --log-throughput.
    line = re.search(r"iteration +6/ +7 \|.*", output).group(0)
    for field in ("consumed samples:           48", "elapsed time per iteration (ms):",
                  "throughput per GPU (TFLOP/s/GPU):", "learning rate:", "global batch size:",
                  "lm loss:", "loss scale: 1.0", "grad norm:", "number of skipped iterations:",
                  "number of nan iterations:", "live replicas: 2", "contributions: 8/8",
                  "failures: 2"):
        assert field in line, (field, line)


def exit_run(tmp_path, name, extra, num_ranks=REPLICAS, recover=True, schedule=None,
             while_running=None):
    """A run with --save; returns (result, recovery-log records, checkpointed iteration)."""
    directory = tmp_path / name
    save = directory / "ckpt"
    args = [*MODEL, "--eval-iters", "0", "--save", str(save), "--save-interval", "1000", *extra]
    if not recover:
        result = launch(LaunchConfig(num_ranks, [*ENTRY, *args], directory / "status",
                                     TIMEOUT_S))
        assert not result.timed_out and result.succeeded, result.output[-4000:]
        records = []
    else:
        if while_running is not None:
            watcher = threading.Thread(target=while_running, args=(directory,), daemon=True)
            watcher.start()
        run = run_training(directory, num_ranks, args, schedule, TIMEOUT_S)
        result, records = run.result, run.records
    tracker = save / "latest_checkpointed_iteration.txt"
    return result, records, int(tracker.read_text()) if tracker.exists() else None


def digests(result) -> set[str]:
    return {s["param_digest"] for s in result.statuses.values() if s["state"] == "completed"}


@pytest.mark.long
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_exit_flags_stop_every_survivor_at_the_same_iteration_and_save(tmp_path):
    # --exit-interval, with a replica lost before the stop; then a relaunch resumes.
    schedule = "entries:\n  - {iteration: 2, replica: 1, local_rank: 0, location: backward}\n"
    result, records, saved = exit_run(tmp_path, "interval",
                                      ["--train-iters", "6", "--exit-interval", "3"],
                                      schedule=schedule)
    assert saved == 3 and [r["iteration"] for r in records] == [1, 2, 3]
    assert "exiting program at iteration 3: --exit-interval 3" in result.output
    assert sorted(r for r, s in result.statuses.items() if s["state"] == "completed") == [0, 2, 3]
    assert len(digests(result)) == 1  # the survivors stopped after the same step
    save = tmp_path / "interval" / "ckpt"
    resumed = run_training(tmp_path / "resumed", 2,
                           [*MODEL, "--eval-iters", "0", "--train-iters", "6",
                            "--load", str(save), "--save", str(save), "--save-interval", "1000"],
                           timeout_s=TIMEOUT_S)
    assert "resumed iteration 3" in resumed.result.output
    assert [r["iteration"] for r in resumed.records] == [4, 5, 6]

    # --exit-signal-handler: one rank receives the signal, every rank stops after one iteration.
    sent = {}

    def signal_one_rank(directory):
        """Once iteration 3 is in the log, send SIGUSR1 to rank 2 (a process the run started,
        by the pid its status file names)."""
        log, status = directory / "log.jsonl", directory / "status" / "rank-2.json"
        deadline = time.time() + TIMEOUT_S
        while time.time() < deadline:
            if log.exists() and len(log.read_text().splitlines()) >= 3 and status.exists():
                pid = json.loads(status.read_text())["pid"]
                os.kill(pid, signal.SIGUSR1)
                sent["after"] = len(log.read_text().splitlines())
                return
            time.sleep(0.02)

    result, records, saved = exit_run(
        tmp_path, "signal", ["--train-iters", "400", "--exit-signal-handler",
                             "--exit-signal", "SIGUSR1"], while_running=signal_one_rank)
    assert sent, "the signal was never sent"
    stop = records[-1]["iteration"]
    assert sent["after"] <= stop < 400 and saved == stop, (sent, stop, saved)
    assert f"exiting program at iteration {stop}" in result.output
    assert len(result.statuses) == REPLICAS and len(digests(result)) == 1
    assert all(s["state"] == "completed" for s in result.statuses.values())

    # --exit-duration-in-mins: every rank is past 0.001 minutes (60 ms from its process start)
    # after iteration 1; under --recover the request rides in the commit lane, in a stock run in
    # an all-reduce.
    for recover in (True, False):
        name = "duration" if recover else "duration-stock"
        result, records, saved = exit_run(tmp_path, name, ["--train-iters", "6",
                                                           "--exit-duration-in-mins", "0.001"],
                                          num_ranks=REPLICAS if recover else 2, recover=recover)
        assert saved == 1 and "exiting program at iteration 1: after" in result.output, name
        assert len(digests(result)) == 1 and records == records[:1]
