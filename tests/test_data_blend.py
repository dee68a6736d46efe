"""A weighted three-corpus blend (`--data-path 0.5 web 0.3 code 0.2 books`, megatron-core's
BlendedDataset) under --recover with two replica failures: exact against the failure-free run,
the ledger's checksums equal to the blend's samples (the audit reads them through megatron's
blend index, not through the microbatch source), the survivors bitwise equal, and the same
arguments without --recover (stock megatron data parallelism) reading the same samples in the
same order: the same losses.

Run: `make test`. CPU only; 4 oversubscribed ranks per run, each under a hard timeout. The three
corpora are the demo corpus's documents dealt into three files, preprocessed with its
tokenizer.
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
    STABLE_LR,
    assert_exact,
    assert_ledger_held,
    megatron_lm_lines,
    printed_values,
    run_training,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
REPLICAS = 4
ITERATIONS = 4
B = 8
SCHEDULE = """entries:
  - {iteration: 2, replica: 1, local_rank: 0, location: during-reduce}
  - {iteration: 3, replica: 2, local_rank: 0, location: backward}
"""


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """(the model and tokenizer arguments, the three corpora's prefixes)."""
    out = tmp_path_factory.mktemp("corpora")
    subprocess.run([sys.executable, str(ROOT / "scripts/make_demo_corpus.py"), "--output-dir",
                    str(out), "--documents", "1200"], check=True, capture_output=True,
                   timeout=300)
    lines = (out / "corpus.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(out / "vocab.json"),
                 "--merge-file", str(out / "merges.txt")]
    blend = []
    for k, name in enumerate(("web", "code", "books")):
        (out / f"{name}.jsonl").write_text("".join(lines[k::3]), encoding="utf-8")
        subprocess.run([sys.executable, str(ROOT / "scripts/preprocess_data.py"), "--input",
                        str(out / f"{name}.jsonl"), "--output-prefix", str(out / name),
                        *tokenizer, "--append-eod"], check=True, capture_output=True,
                       timeout=300)
        blend.append(str(out / f"{name}_text_document"))
    # No dropout: the stock run draws its masks in sequence, not per microbatch id.
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32",
             "--micro-batch-size", "1", "--global-batch-size", str(B), *STABLE_LR, *tokenizer,
             "--ddp-bucket-size", "2000", "--log-interval", "1",
             "--hidden-dropout", "0", "--attention-dropout", "0"]
    return model, blend


@pytest.fixture(scope="module")
def job(corpora):
    model, (web, code, books) = corpora
    return [*model, "--eval-iters", "0", "--train-iters", str(ITERATIONS),
            "--data-path", "0.5", web, "0.3", code, "0.2", books, "--split", "90,5,5"]


def stock_losses(tmp_path, args, ranks):
    """The lm loss of each iteration line and the validation losses of a run without
    --recover."""
    stock = launch(LaunchConfig(ranks, [*ENTRY, *args], tmp_path / "stock", TIMEOUT_S))
    assert not stock.timed_out and stock.succeeded, stock.output[-4000:]
    return printed_values(stock.output, "lm loss"), printed_values(stock.output, "lm loss value")


# make test's budget: in make test-long (tests/test_data.py checks the blend's sample order and
# its shares in process; the failure runs of test_training.py the in-step recovery).
@pytest.mark.long
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_a_blend_survives_two_failures_exactly_and_reads_as_a_stock_run(tmp_path, job, figures):
    reference = run_training(tmp_path / "reference", REPLICAS, job, timeout_s=TIMEOUT_S)
    assert_ledger_held(reference.records, B)
    run = run_training(tmp_path / "failures", REPLICAS, job, SCHEDULE, TIMEOUT_S)
    assert sorted((m["rank"], m["location"], m["iteration"]) for m in run.markers) == [
        (1, "during-reduce", 2), (2, "backward", 3)]  # both faults fired
    assert [r["live_replicas"] for r in run.records] == [4, 3, 2, 2]
    assert_ledger_held(run.records, B)  # the checksums are the blend's samples, every iteration
    loss, params = assert_exact(run, reference, "blend of three corpora, two failures")
    survivors = run.completed()
    assert survivors == [0, 3]
    first = run.params(survivors[0])
    assert all(torch.equal(first[name], run.params(3)[name]) for name in first)

    losses, _ = stock_losses(tmp_path, job, REPLICAS)
    assert len(losses) == ITERATIONS, losses
    expected = megatron_lm_lines({r["iteration"]: r["loss"] for r in reference.records})
    stock_diff = max(abs(e - s) / abs(s) for e, s in zip(expected.values(), losses))
    assert stock_diff <= EXACT_LOSS_RTOL, (losses, [r["loss"] for r in reference.records])
    figures.append(f"blend of three corpora, two failures vs failure-free: loss {loss:.2e}, "
                   f"parameters {params:.2e}; failure-free vs stock: loss {stock_diff:.2e}")


# make test's budget: the blend under failures stays in make test; per-split paths run in
# make test-long.
@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_per_split_blends_train_and_evaluate_as_a_stock_run(tmp_path, corpora):
    """--train-data-path (a weighted blend of two corpora) and --valid-data-path (the third),
    each used whole: the --recover run's training and validation losses equal the stock run's."""
    model, (web, code, books) = corpora
    args = [*model, "--train-iters", "2", "--eval-iters", "1", "--train-data-path", "0.6", web,
            "0.4", code, "--valid-data-path", books]
    run = run_training(tmp_path / "recover", 2, args, timeout_s=TIMEOUT_S)
    assert_ledger_held(run.records, B)
    losses, validation = stock_losses(tmp_path, args, 2)
    assert len(losses) == 2 and len(validation) == 1, (losses, validation)
    expected = megatron_lm_lines({r["iteration"]: r["loss"] for r in run.records})
    assert max(abs(e - s) / s for e, s in zip(expected.values(), losses)) <= EXACT_LOSS_RTOL
    recover_validation = printed_values(run.result.output, "lm loss value")
    assert recover_validation == pytest.approx(validation, rel=EXACT_LOSS_RTOL)
