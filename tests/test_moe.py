"""Mixture-of-experts under --recover: expert parallelism inside a replica.

Run: `make test`. CPU only; 6 oversubscribed ranks per run, each under a hard timeout.

The job: 4 experts (top-2, all-to-all dispatch, load-balancing and z losses) in every layer,
expert-parallel size 2, the distributed optimizer with 3 instances of 2 data-parallel ranks: a
replica is an instance, its expert-parallel group inside it, so a replica holds every expert.
B = 18: each shard runs 3 microbatches. A dead replica's 6 ids give each survivor an
extension pass of 3, so one shard runs 2 and the other 1 and a padding microbatch (the shards
exchange tokens in every forward and must run passes of one length; unpadded, the run hangs in
the all-to-all); two survivors then run 9 ids each, 5 and 4 + 1 per shard.

- Without --overlap-grad-reduce a rank posts its buckets in the order backward completes them:
  its expert bucket, then its dense bucket (which holds the embedding; the start-up line says
  so). Iteration 2: replica 2 dies inside the dense bucket's reduction; iteration 3: replica 1
  dies inside the expert bucket's reduction.
- With --overlap-grad-reduce and --overlap-param-gather: replica 2 dies inside the first bucket
  posted in iteration 2, and replica 1 inside the extension pass that follows; replica 0 then
  runs every lost id.

Every loss, auxiliary loss (the iteration line's load_balancing_loss and z_loss) and final
parameter equals the failure-free run within the exact tolerance (the expert gradients sum
tokens of both shards' microbatches, so their sums round differently when the microbatches run
elsewhere); the ledger holds every iteration; both ranks of a dead replica leave; survivors are
bitwise equal per position.

A mutation (3 one-rank replicas, every expert on each): megatron-core's schedule left to divide
the auxiliary-loss gradient by the pass's microbatches (megatron's own divisor) instead of the
iteration's B. An extension pass is shorter
than a first pass, so its microbatches' router gradients get another weight than in the
failure-free run: the failure run leaves the failure-free trajectory (both runs mutated), and
the exactness check fails.

configs/mixtral_recover.sh, Megatron-LM's Mixtral example launched the megatron-recover way, runs
with its two failures (inside the first bucket reduction, and inside the extension pass that
follows) at smaller sizes, and matches its failure-free run.
"""

import os
import shutil
import subprocess
from pathlib import Path

import megatron.core
import pytest

from megatron_recover.testing.compare import EXACT_RTOL, param_rdiff
from tests.training_harness import (
    STABLE_LR,
    TrainingRun,
    assert_exact,
    assert_ledger_held,
    printed_values,
    run_training,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240
RANKS = 6
B = 18
ITERATIONS = 3
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--eval-iters", "0", "--seq-length", "32", "--max-position-embeddings", "32",
       "--micro-batch-size", "1", "--global-batch-size", str(B),
       "--train-iters", str(ITERATIONS), *STABLE_LR, "--mock-data",
       "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--log-interval", "1",
       "--disable-bias-linear",
       "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
       "--expert-model-parallel-size", "2",
       "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "3"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
# Megatron's rank order: instance r is world ranks 2r and 2r + 1.
# The one expert bucket holds the layers' experts, the dense one the embedding too: backward
# completes the expert bucket first.
BUCKETS_LINE = ("gradient buckets in the order backward completes them, and they are reduced: "
                "expert, dense")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> TrainingRun:
    return run_training(tmp_path_factory.mktemp("moe") / "reference", RANKS, JOB,
                        timeout_s=TIMEOUT_S)


def check_failure_run(run: TrainingRun, reference: TrainingRun, victims: dict, label: str):
    """`victims`: replica -> (killed rank, its peer). The markers fired, the peers left, the
    ledger held, survivors agree bitwise per position and the run is exact."""
    statuses = run.result.statuses
    assert sorted(m["rank"] for m in run.markers) == sorted(v[0] for v in victims.values())
    for killed, peer in victims.values():
        assert statuses[peer]["state"] == "left", statuses[peer]
    dead = {rank for pair in victims.values() for rank in pair}
    assert run.completed() == [r for r in range(RANKS) if r not in dead]
    assert_ledger_held(run.records, B)
    for position in (0, 1):  # the expert-parallel rank (it holds experts 2p, 2p + 1)
        digests = {statuses[r]["param_digest"] for r in run.completed() if r % 2 == position}
        assert len(digests) == 1, (position, digests)
    assert_exact(run, reference, label)
    for name in ("load_balancing_loss", "z_loss"):
        values, expected = (printed_values(r.result.output, name) for r in (run, reference))
        assert len(values) == len(expected) == ITERATIONS, (name, values)
        worst = max(abs(a - b) / abs(b) for a, b in zip(values, expected))
        assert worst <= EXACT_RTOL, (name, values, expected)


def test_failures_in_a_dense_and_an_expert_reduction_stay_exact(tmp_path, reference):
    schedule = ("entries:\n"
                "  - {iteration: 2, replica: 2, local_rank: 1, location: during-reduce, "
                "bucket: 2}\n"
                "  - {iteration: 3, replica: 1, local_rank: 0, location: during-reduce, "
                "bucket: 1}\n")
    run = run_training(tmp_path / "reductions", RANKS, JOB, schedule, TIMEOUT_S)
    assert BUCKETS_LINE in run.result.output
    assert sorted((m["iteration"], m["bucket"], m["rank"]) for m in run.markers) == [
        (2, 2, 5), (3, 1, 2)]  # the dense bucket, then the expert one
    check_failure_run(run, reference, {2: (5, 4), 1: (2, 3)}, "MoE, dense and expert reductions")
    losses = printed_values(run.result.output, "lm loss")
    assert len(losses) == ITERATIONS


@pytest.mark.long  # make test runs the Mixtral list: overlapped, a failure in its extension
def test_failures_with_overlap_and_in_an_extension_pass_stay_exact(tmp_path, reference):
    schedule = ("entries:\n"
                "  - {iteration: 2, replica: 2, local_rank: 0, location: during-reduce}\n"
                "  - {iteration: 2, replica: 1, local_rank: 1, location: during-extension}\n")
    run = run_training(tmp_path / "overlap", RANKS, [*JOB, *OVERLAP], schedule, TIMEOUT_S)
    assert [(m["location"], m["rank"]) for m in sorted(run.markers, key=lambda m: m["time"])] \
        == [("during-reduce", 4), ("during-extension", 3)]
    failures = [e for r in run.records for e in r["events"] if e["event"] == "failure"]
    assert [e["replicas"] for e in failures] == [[2], [1]]
    check_failure_run(run, reference, {2: (4, 5), 1: (3, 2)}, "MoE, overlapped, extension")


# The mutation does not need expert parallelism: 3 one-rank replicas holding every expert, B = 6,
# 2 microbatches per replica; a dead replica's 2 ids are extension passes of 1.
MUTATION_JOB = [*JOB[:JOB.index("--global-batch-size")], "--global-batch-size", "6",
                "--train-iters", "2", *STABLE_LR, "--mock-data", "--tokenizer-type",
                "NullTokenizer", "--vocab-size", "128", "--log-interval", "1",
                "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
                "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]
AUX_SCALE = "loss_scale * cp_size_for_scaling / recover_hooks.loss_divisor(num_microbatches)"


def megatron_with_aux_scale_per_pass(where: Path) -> Path:
    """A copy of the installed (patched) megatron-core whose schedule scales the MoE
    auxiliary-loss gradient by megatron's own divisor, the pass's microbatch count."""
    source = Path(megatron.core.__file__).parent
    copy = where / "megatron" / "core"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (where / "megatron" / "__init__.py").write_text("")
    schedules = copy / "pipeline_parallel" / "schedules.py"
    text = schedules.read_text()
    assert text.count(AUX_SCALE) == 1
    schedules.write_text(
        text.replace(AUX_SCALE, "loss_scale * cp_size_for_scaling / num_microbatches"))
    return where


def test_the_aux_loss_scale_left_per_pass_leaves_the_failure_free_trajectory(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(megatron_with_aux_scale_per_pass(tmp_path / "mutant")))
    reference = run_training(tmp_path / "reference", 3, MUTATION_JOB, timeout_s=TIMEOUT_S)
    schedule = ("entries:\n"
                "  - {iteration: 2, replica: 2, local_rank: 0, location: during-reduce}\n")
    run = run_training(tmp_path / "failure", 3, MUTATION_JOB, schedule, TIMEOUT_S)
    assert [m["rank"] for m in run.markers] == [2]
    assert len(run.records) == 2
    assert_ledger_held(run.records, 6)  # the ledger cannot see a weight: only the trajectory
    params = max(param_rdiff(run.params(r), reference.params(r)) for r in run.completed())
    print(f"aux-loss scale per pass: final parameters {params:.2e} from the failure-free run")
    assert params > 100 * EXACT_RTOL


# configs/mixtral_recover.sh: Megatron-LM's Mixtral example list, its sizes scaled down further
# (later flags win) so that two runs fit `make test`.
MIXTRAL_SCALE = ["--seq-length", "64", "--hidden-size", "64", "--ffn-hidden-size", "224",
                 "--vocab-size", "1024", "--train-iters", "5", "--eval-iters", "2"]


def mixtral_argv(tmp: Path, schedule: str) -> list[str]:
    lines = subprocess.run(["bash", str(ROOT / "configs/mixtral_recover.sh"), str(tmp / "ckpt"),
                            str(tmp / "tb"), "MOCK", schedule], check=True, capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, DRY_RUN="1")).stdout
    lines = lines.splitlines()
    assert int(lines[lines.index("-np") + 1]) == RANKS
    return [*lines[lines.index(str(ROOT / "pretrain_gpt_recover.py")) + 1:], *MIXTRAL_SCALE]


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_the_mixtral_example_list_trains_under_recover_with_failures(tmp_path):
    reference = run_training(tmp_path / "reference", RANKS,
                             mixtral_argv(tmp_path / "reference", "none"), timeout_s=TIMEOUT_S)
    run = run_training(tmp_path / "failure", RANKS, mixtral_argv(
        tmp_path / "failure", str(ROOT / "configs/failures/mixtral_two_failures.yaml")),
        timeout_s=TIMEOUT_S)
    output = run.result.output
    print("\n".join(line for line in output.splitlines()
                    if line.startswith("megatron-recover: mixture") or "iteration " in line
                    or "validation" in line or "optimizer instances" in line))
    assert "2 experts in 2 of 2 layers, top-2 routing, alltoall dispatch" in output
    # The script gives no instance count: start-up chose the replicas of one expert group each.
    assert "--expert-model-parallel-size 2: 3 optimizer instances" in output
    assert sorted((m["location"], m["rank"]) for m in run.markers) == [
        ("during-extension", 2), ("during-reduce", 5)]
    assert run.completed() == [0, 1]
    assert_ledger_held(run.records, 12)
    assert (tmp_path / "failure/ckpt/iter_0000004/metadata.json").is_file()
    assert len(printed_values(output, "load_balancing_loss")) == 5
    assert len(printed_values(output, "lm loss value")) == 3  # iteration 4, then valid and test
    assert_exact(run, reference, "the Mixtral list, two failures")


@pytest.mark.long
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_a_save_after_the_lowest_replicas_died_resumes_exactly(tmp_path, reference):
    """Replicas 0 and 2 die in iteration 1; replica 1, the lowest live one, saves (torch_dist)
    after iteration 2. megatron counts an expert tensor's copies by expert data-parallel rank,
    S / E per replica: unshifted, no copy of an expert would be the main one, and the save
    hung (tried once). A relaunch resumes iteration 3 and ends as the failure-free run."""
    schedule = ("entries:\n"
                "  - {iteration: 1, replica: 0, local_rank: 0, location: during-reduce}\n"
                "  - {iteration: 1, replica: 2, local_rank: 1, location: during-extension}\n")
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2", "--exit-interval", "2"]
    run = run_training(tmp_path / "failure", RANKS, [*JOB, *save], schedule, TIMEOUT_S)
    assert run.completed() == [2, 3] and [r["iteration"] for r in run.records] == [1, 2]
    resumed = run_training(tmp_path / "resumed", RANKS, [*JOB, "--load", str(tmp_path / "ckpt")],
                           timeout_s=TIMEOUT_S)
    assert [r["iteration"] for r in resumed.records] == [3]
    loss = abs(resumed.records[0]["loss"] / reference.records[2]["loss"] - 1)
    params = max(param_rdiff(resumed.params(r), reference.params(r)) for r in range(RANKS))
    print(f"MoE, a save by replica 1, resumed: loss {loss:.2e}, final parameters {params:.2e}")
    assert loss <= EXACT_RTOL and params <= EXACT_RTOL
