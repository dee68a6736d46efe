"""Without --recover, patched megatron-core trains exactly like an unpatched install.

Run: `make test`. CPU only. The unpatched copy is megatron-core's verified source distribution
(downloaded by `make setup`) extracted without our patches and put first on PYTHONPATH; both runs
are the same 4-rank job on the same data, and must end with bitwise-equal parameters, in fp32,
bf16 and fp16 (Float16Module and megatron's mixed-precision optimizer). The same for a
mixture-of-experts job (2 ranks, expert-parallel size 2, all-to-all dispatch, load-balancing and z
losses), whose router megatron-core 0.19 runs without Transformer Engine as it is.
"""

import shutil
import tarfile
from pathlib import Path

import pytest

import megatron.core
from megatron_recover.launch import LaunchConfig, launch
from tests.mpirun_harness import ENTRY

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--eval-iters", "0",
       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
       "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-2", "--mock-data",
       "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--log-interval", "1"]


def unpatched_megatron(tmp_path: Path) -> Path:
    lock = dict(line.split("=", 1) for line in (ROOT / "megatron-core.lock").read_text().split()
                if "=" in line)
    sdist = ROOT / f"third_party/dist/megatron_core-{lock['version']}.tar.gz"
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    source = tmp_path / f"megatron_core-{lock['version']}"
    # The compiled dataset helpers come from the same (unpatched) helpers.cpp.
    installed = Path(megatron.core.__file__).parent / "datasets"
    for helper in installed.glob("helpers_cpp*.so"):
        shutil.copy(helper, source / "megatron/core/datasets" / helper.name)
    return source


def stock_run(tmp_path: Path, name: str, precision: list[str]):
    result = launch(LaunchConfig(4, [*ENTRY, *JOB, *precision], tmp_path / name,
                                 timeout_s=TIMEOUT_S))
    assert result.succeeded, result.output[-4000:]
    losses = [line.split("lm loss:")[1].split("|")[0].strip()
              for line in result.output.splitlines() if "lm loss:" in line]
    digests = {s["param_digest"] for s in result.statuses.values()}
    return result.output, losses, digests


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
# The hooks are the same in every precision: `make test` runs fp32, `make test-long` the others.
@pytest.mark.parametrize("precision", [
    # make test: the MoE job below, through the same hooks (and the MoE ones).
    pytest.param([], id="fp32", marks=pytest.mark.long),
    pytest.param(["--bf16"], id="bf16", marks=pytest.mark.long),
    pytest.param(["--fp16", "--initial-loss-scale", "4096"], id="fp16", marks=pytest.mark.long)])
def test_patched_without_recover_equals_unpatched(tmp_path, monkeypatch, precision):
    _, patched_losses, patched_digests = stock_run(tmp_path, "patched", precision)
    source = unpatched_megatron(tmp_path)
    assert "recover_hooks" not in (source / "megatron/core/pipeline_parallel/schedules.py").read_text()
    monkeypatch.setenv("PYTHONPATH", str(source))
    output, unpatched_losses, unpatched_digests = stock_run(tmp_path, "unpatched", precision)
    assert f"from {source}/megatron/core" in output, output[-2000:]
    assert len(patched_losses) == 4 and patched_losses == unpatched_losses
    assert len(patched_digests) == 1 and patched_digests == unpatched_digests


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
       "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
       "--disable-bias-linear"]
MOE_RANKS = 2  # one expert-parallel group of 2, which is the data-parallel group


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_moe_without_recover_equals_unpatched(tmp_path, monkeypatch):
    patched = launch(LaunchConfig(MOE_RANKS, [*ENTRY, *JOB, *MOE], tmp_path / "patched",
                                  timeout_s=TIMEOUT_S))
    assert patched.succeeded, patched.output[-4000:]
    source = unpatched_megatron(tmp_path)  # megatron-core 0.19's router runs without TE as is
    monkeypatch.setenv("PYTHONPATH", str(source))
    unpatched = launch(LaunchConfig(MOE_RANKS, [*ENTRY, *JOB, *MOE], tmp_path / "unpatched",
                                    timeout_s=TIMEOUT_S))
    assert unpatched.succeeded, unpatched.output[-4000:]
    assert f"from {source}/megatron/core" in unpatched.output
    lines = [[line.split("lm loss:")[1].split("|")[0] + line.split("z_loss:")[1].split("|")[0]
              for line in run.output.splitlines() if "lm loss:" in line]
             for run in (patched, unpatched)]
    assert len(lines[0]) == 4 and lines[0] == lines[1]
    digests = [{rank: status["param_digest"] for rank, status in run.statuses.items()}
               for run in (patched, unpatched)]
    assert len(set(digests[0].values())) == 2  # the two expert-parallel ranks' parameters
    assert digests[0] == digests[1]
