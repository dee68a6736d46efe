"""--calculate-per-token-loss under --recover: the gradient is divided once, after the commit, by
the loss tokens of the committed microbatches, which the commit lane counts from the ledger.

Run: `make test`. CPU only, 5 oversubscribed ranks, each run under a hard timeout. The data is
the demo corpus with --eod-mask-loss, so the loss tokens of a microbatch vary with the
end-of-document tokens it holds and a division by anything else (microbatches, tokens of
another set of ids) gives other numbers. The references are megatron-core's own per-token path
(a run without --recover: finalize_model_grads all-reduces the token count and divides) and the
failure-free --recover run; the run's audit checks every committed count against the dataset.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_recover.launch import LaunchConfig, launch
from tests.mpirun_harness import ENTRY
from tests.training_harness import (
    EXACT_LOSS_RTOL,
    EXACT_PARAM_RTOL,
    STABLE_LR,
    assert_exact,
    param_rdiff,
    megatron_lm_lines,
    printed_values,
    run_training,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e, pytest.mark.long]
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
REPLICAS = 5
ITERATIONS = 5
SEQ = 32
B = 20
# Iteration 3: replica 1 dies inside a bucket's all-reduce (a policy boundary), replica 2 inside
# the extension pass that follows.
SCHEDULE = """entries:
  - {iteration: 3, replica: 1, local_rank: 0, location: during-reduce}
  - {iteration: 3, replica: 2, local_rank: 0, location: during-extension}
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, str(ROOT / "scripts/make_demo_corpus.py"), "--output-dir", str(out)],
                   check=True, capture_output=True, timeout=300)
    # No dropout: megatron-core's own run draws its masks in sequence, not per microbatch id.
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--eval-iters", "0", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
            "--micro-batch-size", "1", "--global-batch-size", str(B),
            "--train-iters", str(ITERATIONS), *STABLE_LR,
            "--data-path", str(out / "corpus_text_document"), "--split", "949,50,1",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(out / "vocab.json"),
            "--merge-file", str(out / "merges.txt"), "--eod-mask-loss",
            "--calculate-per-token-loss", "--overlap-grad-reduce", "--ddp-bucket-size", "2000",
            "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, job):
    run = run_training(tmp_path_factory.mktemp("reference") / "run", REPLICAS, job,
                       timeout_s=TIMEOUT_S)
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    return run


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_failure_free_run_divides_as_megatron_core_does(tmp_path, job, reference):
    stock = launch(LaunchConfig(REPLICAS, [*ENTRY, *job], tmp_path / "stock", TIMEOUT_S))
    assert not stock.timed_out and stock.succeeded, stock.output[-4000:]
    losses = printed_values(stock.output, "lm loss")
    assert len(losses) == ITERATIONS, stock.output[-4000:]
    tokens = [r["loss_tokens"] for r in reference.records]
    print(f"committed loss tokens {tokens} of {B * SEQ} positions per iteration")
    # The mask is active and differs between iterations: the division is by what the data has.
    assert all(0 < n < B * SEQ for n in tokens) and len(set(tokens)) > 1, tokens
    assert all(r["invariant_ok"] for r in reference.records), reference.records
    # megatron-core's run prints its loss with 7 significant digits.
    expected = megatron_lm_lines({r["iteration"]: r["loss"] for r in reference.records})
    loss = max(abs(e - s) / abs(s) for e, s in zip(expected.values(), losses))
    params = param_rdiff(reference.params(0), torch.load(tmp_path / "stock/rank-0.params.pt"))
    print(f"recover vs megatron-core per-token loss: loss {loss:.2e}, parameters {params:.2e}")
    assert loss <= 1e-6
    assert params <= EXACT_PARAM_RTOL


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_failure_in_extension_pass_keeps_the_token_count(tmp_path, job, reference):
    run = run_training(tmp_path / "exact", REPLICAS, job, SCHEDULE, TIMEOUT_S)
    assert sorted((m["rank"], m["iteration"], m["location"]) for m in run.markers) == [
        (1, 3, "during-reduce"), (2, 3, "during-extension")]
    assert run.records[2]["extension_rounds"] == 2  # the extension pass itself lost a replica
    assert [r["live_replicas"] for r in run.records] == [5, 5, 3, 3, 3]
    assert all(r["invariant_ok"] and r["contributions"] == B for r in run.records)
    assert [r["loss_tokens"] for r in run.records] == [r["loss_tokens"] for r in reference.records]
    assert_exact(run, reference, "per-token loss, failure in the extension pass")
    digests = {run.result.statuses[r]["param_digest"] for r in run.completed()}
    assert len(digests) == 1, digests


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_drop_and_go_divides_by_the_committed_tokens(tmp_path, job, reference):
    run = run_training(tmp_path / "adaptive", REPLICAS, [*job, "--recover-policy", "adaptive"],
                       SCHEDULE, TIMEOUT_S)
    failed = run.records[2]
    full = reference.records[2]
    print(f"iteration 3: {failed['contributions']} microbatches, {failed['loss_tokens']} tokens "
          f"committed; failure-free {full['contributions']}, {full['loss_tokens']}")
    assert failed["contributions"] < B
    # The audit compared the count with the dataset's tokens of exactly the committed ids.
    assert all(r["invariant_ok"] for r in run.records), [r["ledger_problems"] for r in run.records]
    assert 0 < failed["loss_tokens"] < full["loss_tokens"]
    assert abs(run.records[1]["loss"] - reference.records[1]["loss"]) <= (
        EXACT_LOSS_RTOL * abs(reference.records[1]["loss"]))

