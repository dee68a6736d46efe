"""configs/: the scaled Megatron-LM example job scripts parse, start-up checks included.

Each script prints its command with DRY_RUN=1; the arguments after pretrain_gpt_recover.py go
through the same parse and start-up checks a launch runs (`arguments.parse_args`,
`run.check_start`: the failure schedule against the job), with the script's rank count. The
docs/running.md's run of configs/gpt3_recover.sh shows what a launch prints.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_recover.megatron.config import arguments
from megatron_recover.megatron.app import run

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, str(ROOT / "scripts/make_demo_corpus.py"), "--output-dir",
                    str(out)], check=True, timeout=300, capture_output=True)
    return out


def command(script: str, *args: str) -> list[str]:
    out = subprocess.run(["bash", str(ROOT / "configs" / script), *args], check=True,
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, DRY_RUN="1")).stdout.splitlines()
    assert out[1:3] == ["--with-ft", "ulfm"], out[:4]
    return out


def parsed(lines: list[str]):
    np = int(lines[lines.index("-np") + 1])
    argv = lines[lines.index(str(ROOT / "pretrain_gpt_recover.py")) + 1:]
    cfg = arguments.parse_args(argv, world_size=np, cuda_available=False)
    run.check_start(cfg)
    return cfg


def test_gpt3_script_parses_with_its_failures(corpus, tmp_path):
    cfg = parsed(command("gpt3_recover.sh", str(tmp_path / "ckpt"), str(tmp_path / "tb"),
                         str(corpus / "vocab.json"), str(corpus / "merges.txt"),
                         str(corpus / "corpus_text_document")))
    assert cfg.recover.enabled and cfg.recover.failure_schedule.name == "gpt3_two_failures.yaml"
    assert (cfg.parallel.pipeline_model_parallel_size, cfg.num_replicas) == (2, 4)
    assert cfg.precision.fp16 and cfg.train_iters == 40
    assert (cfg.evaluation.interval, cfg.evaluation.iters) == (10, 2)
    assert cfg.logging.tensorboard_dir == tmp_path / "tb"
    assert cfg.checkpoint.save == cfg.checkpoint.load == str(tmp_path / "ckpt")
    assert not [line for line in cfg.notices if "no effect" in line]


def test_llama3_script_parses_with_its_failures(tmp_path):
    cfg = parsed(command("llama3_recover.sh", str(tmp_path / "ckpt"), str(tmp_path / "tb")))
    m = cfg.model
    assert (m.num_query_groups, m.swiglu, m.position_embedding_type) == (2, True, "rope")
    assert m.calculate_per_token_loss and cfg.precision.bf16
    assert cfg.parallel.use_distributed_optimizer and cfg.parallel.overlap_param_gather
    assert cfg.exit.duration_mins == 235 and cfg.logging.log_throughput
    assert cfg.train_iters == 30 and cfg.num_replicas == 4
    # The flags that change nothing here are said at start-up, not dropped silently.
    said = " ".join(cfg.notices)
    for flag in ("--use-mcore-models", "--manual-gc", "--tiktoken-pattern",
                 "--distributed-timeout-minutes", "--num-workers"):
        assert flag in said, flag


def test_slurm_script_launches_on_the_allocation_with_its_last_node_spare(tmp_path):
    """configs/slurm_recover.sbatch: the allocation's nodes (NODES stands in for Slurm's list)
    become the hostfile, the last one the spare; the job's arguments pass through unchanged;
    an allocation too small for a spare stops with the reason."""
    script = str(ROOT / "configs/slurm_recover.sbatch")
    env = dict(os.environ, DRY_RUN="1", NODES="gpu01,gpu02,gpu03",
               HOSTFILE=str(tmp_path / "hosts"), RUN_DIR=str(tmp_path / "run"),
               PATH="/usr/bin:/bin")
    out = subprocess.run(["bash", script, "8", "--recover", "--train-iters", "5"], env=env,
                         check=True, capture_output=True, text=True, timeout=60).stdout.split()
    assert (tmp_path / "hosts").read_text() == "gpu01 slots=8\ngpu02 slots=8\n"
    assert out[1:10] == ["launch", "--hostfile", str(tmp_path / "hosts"), "--spare-hosts",
                         "gpu03", "--max-relaunches", "2", "--status-dir",
                         str(tmp_path / "run" / "status")], out
    assert out[-4:] == [str(ROOT / "pretrain_gpt_recover.py"), "--recover", "--train-iters",
                        "5"], out
    small = subprocess.run(["bash", script, "8"], env=dict(env, NODES="gpu01"),
                           capture_output=True, text=True, timeout=60)
    assert small.returncode == 2 and "the spare needs at least 2" in small.stderr


def test_slurm_script_starts_one_rank_per_gpu_of_each_node(tmp_path):
    """The GPU recipe: the #SBATCH lines ask for 8 GPUs and 8 tasks (the ranks' slots) per node
    and keep the allocation when a node fails; RANKS_PER_NODE defaults to Slurm's tasks per node,
    else the node's GPU count (SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE, else nvidia-smi -L),
    which RANKS_PER_NODE in the environment and, before it, a first argument override, up to the
    tasks per node; the printed command is the relaunching launcher's (it runs mpirun --with-ft
    ulfm) around pretrain_gpt_recover.py and the job's arguments."""
    script = ROOT / "configs/slurm_recover.sbatch"
    sbatch = [line.split()[1] for line in script.read_text().splitlines()
              if line.startswith("#SBATCH")]
    assert {"--gpus-per-node=8", "--ntasks-per-node=8", "--no-kill"} <= set(sbatch), sbatch
    hosts, fake_bin = tmp_path / "hosts", tmp_path / "bin"
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in ("RANKS_PER_NODE", "NODES")}
    base.update(DRY_RUN="1", NODES="a,b,c", HOSTFILE=str(hosts), RUN_DIR=str(tmp_path / "run"),
                PATH="/usr/bin:/bin")

    def launch(*args: str, **env: str) -> list[str]:
        return subprocess.run(["bash", str(script), *args], env=dict(base, **env), check=True,
                              capture_output=True, text=True, timeout=60).stdout.split()

    out = launch("--recover", "--train-iters", "5", SLURM_GPUS_ON_NODE="8")
    assert hosts.read_text() == "a slots=8\nb slots=8\n"
    assert out[0] == str(ROOT / ".venv/bin/megatron-recover")
    assert out[1:13] == ["launch", "--hostfile", str(hosts), "--spare-hosts", "c",
                         "--max-relaunches", "2", "--status-dir", str(tmp_path / "run/status"),
                         "--", str(ROOT / ".venv/bin/python"),
                         str(ROOT / "pretrain_gpt_recover.py")], out
    assert out[13:] == ["--recover", "--train-iters", "5"], out

    def slots(*args: str, **env: str) -> str:
        launch(*args, "--recover", **env)
        return hosts.read_text()

    assert slots("4", SLURM_GPUS_ON_NODE="8") == "a slots=4\nb slots=4\n"
    assert slots(SLURM_GPUS_ON_NODE="8", RANKS_PER_NODE="2") == "a slots=2\nb slots=2\n"
    assert slots("4", SLURM_GPUS_ON_NODE="8", RANKS_PER_NODE="2") == "a slots=4\nb slots=4\n"
    assert slots(SLURM_GPUS_PER_NODE="gpu:h100:4") == "a slots=4\nb slots=4\n"
    assert slots(SLURM_NTASKS_PER_NODE="2", SLURM_GPUS_ON_NODE="8") == "a slots=2\nb slots=2\n"
    more = subprocess.run(["bash", str(script), "4", "--recover"], capture_output=True,
                          text=True, env=dict(base, SLURM_NTASKS_PER_NODE="2"), timeout=60)
    assert more.returncode == 2 and "sbatch --ntasks-per-node=4" in more.stderr, more.stderr
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text(
        "#!/bin/sh\n[ \"$1\" = -L ] || exit 1\n"
        "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n"
        "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    assert slots(PATH=f"{fake_bin}:/usr/bin:/bin") == "a slots=2\nb slots=2\n"
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2; exit 9\n")
    none = subprocess.run(["bash", str(script), "--recover"], capture_output=True, text=True,
                          env=dict(base, PATH=f"{fake_bin}:/usr/bin:/bin"), timeout=60)
    assert none.returncode == 2 and "give it as the first argument" in none.stderr
