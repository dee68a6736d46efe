"""A user's own seams under --recover: tests/data/user_gpt_recover.py, a script that defines its
own `model_provider` (a GPT whose final norm carries a learnable head scale) and `forward_step`
and calls the entry's `pretrain`, loses a replica inside a gradient reduction and keeps its own
failure-free loss curve, evaluation included. What the run wraps around the user's forward
step (the ledger, per-id reseeding with dropout on, padding, fault points) is what makes it
exact; the ledger is checked, the fault shown to have fired, and the user's seams shown to have
run: the head scale is among the trained parameters, and each rank noted its provider and its
forward step in training and in evaluation.

Run: `make test-long` (two more mpirun jobs, about a minute; `make test` keeps the seams' unit
tests in tests/unit/test_entry_point.py and test_model_build.py, and every end-to-end run there
goes through the entry's default seams). CPU only; 3 oversubscribed one-rank replicas, two runs
of 4 iterations.
"""

import json
import sys
from pathlib import Path

import pytest

from tests.training_harness import (
    EXACT_LOSS_RTOL,
    STABLE_LR,
    assert_exact,
    assert_ledger_held,
    printed_values,
    run_training,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e, pytest.mark.long]
SCRIPT = Path(__file__).parent / "data" / "user_gpt_recover.py"
TIMEOUT_S = 240
REPLICAS = 3
ITERATIONS = 4
B = 6
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
       "--global-batch-size", str(B), "--train-iters", str(ITERATIONS), *STABLE_LR,
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--ddp-bucket-size", "2000", "--log-interval", "1",
       "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
       "--eval-iters", "1", "--eval-interval", "2"]
# Replica 1 dies inside a bucket's all-reduce of iteration 2: its ids go to an extension pass.
SCHEDULE = "entries:\n  - {iteration: 2, replica: 1, local_rank: 0, location: during-reduce}\n"
HEAD_SCALE = "decoder.final_layernorm.head_scale"


def seams(run, rank: int) -> list[dict]:
    path = run.status_dir / f"user-seams-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_a_users_model_provider_and_forward_step_stay_exact_through_a_failure(tmp_path, figures):
    entry = [sys.executable, str(SCRIPT)]
    reference = run_training(tmp_path / "reference", REPLICAS, JOB, None, TIMEOUT_S, entry)
    run = run_training(tmp_path / "failure", REPLICAS, JOB, SCHEDULE, TIMEOUT_S, entry)

    assert [(m["rank"], m["iteration"], m["location"]) for m in run.markers] == [
        (1, 2, "during-reduce")]
    assert run.completed() == [0, 2]
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    assert_ledger_held(run.records, B)
    assert [r["live_replicas"] for r in run.records] == [3, 2, 2, 2]
    loss, params = assert_exact(run, reference, "user's model_provider and forward_step")

    # Evaluation goes through the user's forward step too: after iterations 2 and 4, and the
    # validation and test splits at the end; the survivors re-split its ids and get the same
    # values.
    evaluated, expected = (printed_values(r.result.output, "lm loss value")
                           for r in (run, reference))
    assert len(expected) == 4 and len(evaluated) == len(expected), (evaluated, expected)
    eval_diff = max(abs(a - b) / abs(b) for a, b in zip(evaluated, expected))
    assert eval_diff <= EXACT_LOSS_RTOL, eval_diff

    # The user's seams ran: its model is the one trained (the head scale moved from its start)
    # and every rank called its provider and its forward step, in training and evaluation.
    for rank in run.completed():
        scale = float(run.params(rank)[HEAD_SCALE])
        assert scale != 2.0, scale
        noted = seams(run, rank)
        assert {"seam": "model_provider", "vp_stage": None, "pre_process": True,
                "post_process": True} in noted, noted
        assert {"seam": "forward_step", "training": True} in noted, noted
        assert {"seam": "forward_step", "training": False} in noted, noted
    figures.append(f"user's model_provider/forward_step, 1 of 3 replicas lost vs its "
                   f"failure-free run: loss {loss:.2e}, parameters {params:.2e}, evaluation "
                   f"{eval_diff:.2e} (tolerance {EXACT_LOSS_RTOL:.0e})")
