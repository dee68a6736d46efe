"""Every Megatron-LM argument has one status, the docs table is the code's, and the argument lists
of Megatron-LM's two example job scripts run under --recover.

Run:  .venv/bin/python -m pytest tests/test_argument_table.py -q -p no:cacheprovider
Hardware: a CPU. The table checks are in-process (seconds): each of the 846 names of
Megatron-LM's parser at core_v0.19.0 (tests/data/, source named there) is given on a command line
and must do what its status says: refused names stop with a ValueError that names them,
no-effect names parse and are named at start-up, implemented names are the parser's. The
example-script tests (marked mpi) run 4 oversubscribed ranks under a hard timeout: the Llama-3
list (sizes scaled down) with a replica failure inside a gradient reduction, and the GPT-3 list.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_recover.megatron.config import argument_table
from megatron_recover.megatron.config.argument_table import IMPLEMENTED, NO_EFFECT, OURS, REFUSED
from megatron_recover.megatron.config.arguments import build_parser, parse_args
from tests.training_harness import assert_ledger_held, loss_rdiff, run_training

ROOT = Path(__file__).resolve().parent.parent
MEGATRON_NAMES = [line.split()[0] for line in
                  (ROOT / "tests/data/megatron_lm_core_v0.19.0_arguments.txt").read_text().splitlines()
                  if line.startswith("--")]
SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--micro-batch-size 2 --train-iters 20 --lr 1e-3 --mock-data --vocab-size 100").split()
TABLE = argument_table.table(build_parser())


def parse(*extra):
    return parse_args([*SMALL, *extra], world_size=4, cuda_available=False)


def test_every_megatron_argument_has_one_status():
    assert len(MEGATRON_NAMES) == len(set(MEGATRON_NAMES)) == 846
    missing = [name for name in MEGATRON_NAMES if name not in TABLE]
    assert not missing, f"no status: {missing}"
    counts = {status: sum(TABLE[n].status == status for n in MEGATRON_NAMES)
              for status in (IMPLEMENTED, REFUSED, NO_EFFECT)}
    print(f"Megatron-LM's 846 arguments: {counts}")
    assert sum(counts.values()) == 846
    # Whatever the table knows beyond Megatron-LM's names is ours, and said to be.
    assert {n for n in TABLE if n not in MEGATRON_NAMES} == {
        n for n, e in TABLE.items() if e.status == OURS}
    for name, entry in TABLE.items():
        assert entry.status == IMPLEMENTED or entry.status == OURS or entry.reason, name


@pytest.mark.parametrize("name", [n for n in MEGATRON_NAMES if TABLE[n].status == REFUSED])
def test_refused_argument_stops_with_its_reason(name):
    with pytest.raises(ValueError) as info:
        parse(name, "2")  # a value other than the one a few of them accept
    assert f"{name}: {TABLE[name].reason}" in str(info.value)


@pytest.mark.parametrize("name", [n for n in MEGATRON_NAMES if TABLE[n].status == NO_EFFECT])
def test_no_effect_argument_is_accepted_and_named(name):
    values = [] if TABLE[name].nargs == 0 else ["1"]
    cfg = parse(name, *values)
    assert [line for line in cfg.notices if f" {name}" in line] == [
        f"megatron-recover: no effect here: {name}: {TABLE[name].reason}"]
    assert cfg == parse().__class__(**{**vars(parse()), "notices": cfg.notices})


def test_implemented_arguments_are_the_parsers():
    parsed = {name for action in build_parser()._actions for name in action.option_strings}
    implemented = {n for n in MEGATRON_NAMES if TABLE[n].status == IMPLEMENTED}
    assert implemented <= parsed
    assert not {n for n in MEGATRON_NAMES if TABLE[n].status == REFUSED} & parsed


def test_docs_table_is_current():
    result = subprocess.run([sys.executable, "scripts/argument_table.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------------------------
# Megatron-LM's example job scripts at core_v0.16.1, argument for argument, sizes scaled down
# (4 CPU ranks instead of 8 GPUs per node; a few iterations). What differs is said at each line.
# --------------------------------------------------------------------------------------------

# examples/llama/train_llama3_8b_h100_fp8.sh, mock-data branch.
LLAMA3_MODEL = [
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "224",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "16", "--seq-length", "64", "--max-position-embeddings", "64",
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu",
    "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]
LLAMA3_ITERATIONS = 6
LLAMA3_TRAINING = [
    "--micro-batch-size", "1", "--global-batch-size", "8",
    "--train-samples", str(8 * LLAMA3_ITERATIONS), "--lr-decay-samples", "40",
    "--lr-warmup-samples", "8", "--lr", "0.00015", "--min-lr", "0.00001",
    "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine",
    "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss", "--manual-gc",
    "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
]
LLAMA3_PARALLEL = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "1",
                   "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--overlap-param-gather"]


def llama3_data_and_logging(tmp: Path) -> list[str]:
    return [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
        "--data-cache-path", str(tmp / "cache"), "--tiktoken-pattern", "v2",
        "--split", "'99,1,0'",  # the script's quotes reach argv: Megatron reads the digits
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "100",  # 32: scaled
        "--save-interval", "1000", "--log-throughput", "--profile-step-start", "4",
        "--profile-step-end", "6", "--ckpt-format", "torch_dist",
        "--distributed-timeout-minutes", "60",
        "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"),
        "--tensorboard-dir", str(tmp / "tb"),
    ]


# What the script has and --recover refuses, with the reason; each is stripped from the run.
LLAMA3_REFUSED = {
    ("--fp8-format", "hybrid"): "fp8/fp4 training needs a CUDA device",
    ("--fp8-amax-history-len", "1024"): "fp8/fp4 training needs a CUDA device",
    ("--fp8-amax-compute-algo", "max"): "fp8/fp4 training needs a CUDA device",
    ("--fp8-param-gather",): "fp8/fp4 training needs a CUDA device",
    ("--profile",): "the CUDA profiler (nsys) needs a CUDA device",
}


def test_llama3_script_refusals_say_why(tmp_path):
    argv = [*LLAMA3_MODEL, *LLAMA3_TRAINING, *LLAMA3_PARALLEL, *llama3_data_and_logging(tmp_path),
            "--recover"]
    for flag, reason in LLAMA3_REFUSED.items():
        with pytest.raises(ValueError) as info:
            parse_args([*argv, *flag], world_size=4, cuda_available=False)
        lines = str(info.value).splitlines()[1:]
        assert len(lines) == 1 and flag[0] in lines[0] and reason in lines[0], (flag, lines)


@pytest.mark.long
@pytest.mark.mpi
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_llama3_argument_list_trains_under_recover_with_a_failure(tmp_path):
    args = [*LLAMA3_MODEL, *LLAMA3_TRAINING, *LLAMA3_PARALLEL]
    reference = run_training(tmp_path / "reference", 4,
                             [*args, *llama3_data_and_logging(tmp_path / "reference")],
                             timeout_s=240)
    schedule = ("entries:\n  - {iteration: 3, replica: 1, local_rank: 1, "
                "location: during-reduce}\n")
    # The job stops after iteration 4 (--exit-interval), saving its --save directory (torch_dist,
    # the script's format) after the failure; its relaunch with the same --save d --load d
    # continues.
    failure_args = [*args, *llama3_data_and_logging(tmp_path / "failure")]
    run = run_training(tmp_path / "failure", 4, [*failure_args, "--exit-interval", "4"],
                       schedule, 240)
    output = run.result.output
    print("\n".join(line for line in output.splitlines() if line.startswith("megatron-recover")
                    or "iteration " in line))
    for expected in ("bf16 parameters", "no effect here: --use-mcore-models",
                     "one optimizer instance per replica (--num-distributed-optimizer-instances 2)",
                     "--attention-backend fused has no effect with the local layer spec",
                     "--cross-entropy-loss-fusion: the fused kernel is CUDA-only"):
        assert expected in output, expected
    assert [(m["rank"], m["location"]) for m in run.markers] == [(3, "during-reduce")]
    assert run.completed() == [0, 1]
    assert [r["iteration"] for r in run.records] == [1, 2, 3, 4]
    assert_ledger_held(run.records, 8)
    assert run.records[-1]["live_replicas"] == 1
    # --calculate-per-token-loss: the mock data masks no token, so every iteration divides by
    # all 8 x 64 of its positions.
    assert [r["loss_tokens"] for r in run.records] == [8 * 64] * 4
    assert (tmp_path / "failure/ckpt/iter_0000004/metadata.json").is_file()  # the exit's save
    relaunch = run_training(tmp_path / "relaunch", 4, failure_args, timeout_s=240)
    assert "resumed iteration 4" in relaunch.result.output
    assert [r["iteration"] for r in relaunch.records] == [5, 6]
    assert relaunch.records[0]["live_replicas"] == 2
    continued = run.records + relaunch.records
    print("iteration: uninterrupted / failure, then relaunch")
    for mine, theirs in zip(continued, reference.records):
        print(f"  {mine['iteration']}: {theirs['loss']:.7f} / {mine['loss']:.7f}")
    # bf16 gradients reduced in bf16: a failure changes the reduction order, so the loss is
    # close, not equal (tests/test_precision.py measures the tolerance of this precision).
    rdiff = loss_rdiff(continued, reference.records)
    print(f"largest relative loss difference {rdiff:.2e}")
    assert rdiff < 1e-3


# examples/gpt3/train_gpt3_175b_distributed.sh
def gpt3_argv(tmp: Path, corpus: dict) -> list[str]:
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "4", "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16",
        "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
        "--lr-warmup-fraction", ".001", "--lr-decay-iters", "4",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--data-path", corpus["prefix"], "--vocab-file", corpus["vocab"],
        "--merge-file", corpus["merges"], "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"), "--eval-iters", "10",
        "--tensorboard-dir", str(tmp / "tb"),
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The demo corpus with its GPT-2 BPE files (scripts/make_demo_corpus.py, offline)."""
    out = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, str(ROOT / "scripts/make_demo_corpus.py"),
                    "--output-dir", str(out)], check=True, capture_output=True, timeout=300)
    return {"prefix": str(out / "corpus_text_document"), "vocab": str(out / "vocab.json"),
            "merges": str(out / "merges.txt")}


def test_gpt3_script_batch_size_schedule_is_refused_as_megatron_lm_refuses_it(tmp_path, corpus):
    # Megatron-LM core_v0.19.0's GPT-3 example passes both --global-batch-size and
    # --step-batch-size-schedule, which its own argument validation refuses; and the
    # deprecated --rampup-batch-size of earlier releases is refused with the way forward.
    schedule = ["--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"]
    for extra, expected in ((schedule, "Cannot specify both --step-batch-size-schedule and "
                                       "--global-batch-size"),
                            (["--rampup-batch-size", "16", "16", "5859375"],
                             "--rampup-batch-size: deprecated by Megatron-LM 0.19")):
        with pytest.raises(ValueError) as info:
            parse_args([*gpt3_argv(tmp_path, corpus), *extra, "--recover"], world_size=4,
                       cuda_available=False)
        assert expected in str(info.value)


@pytest.mark.mpi
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_gpt3_argument_list_trains_under_recover(tmp_path, corpus):
    run = run_training(tmp_path / "run", 4, gpt3_argv(tmp_path, corpus), timeout_s=240)
    assert "fp16 parameters" in run.result.output
    assert [r["iteration"] for r in run.records] == [1, 2, 3, 4]
    assert_ledger_held(run.records, 8)
    assert run.completed() == [0, 1, 2, 3]
