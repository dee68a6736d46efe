"""Every command the README and the docs/ pages show runs, with sizes scaled down, so documented
commands cannot break silently.

Run: `make test`. CPU only; each command runs bounded (its process group is killed on timeout).
The commands are read from the README and the docs/ pages themselves: their `sh` blocks and the
inline code spans that start a command. Each must have an entry in COMMANDS — how this test runs
it (scaled down), or why it does not run here — so a command added to a page without one fails
the first test.
"""

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from megatron_recover.launch import run_bounded

pytestmark = pytest.mark.mpi
ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
VENV = Path(sys.executable).parent
TIMEOUT_S = 300
STARTS = ("make ", ".venv/bin/", "megatron-recover ", "mpirun ", "scripts/", "git ", "for ",
          "pip ", "configs/")

# The README's pretrain command, scaled down: 2 ranks, a batch of 4, 2 iterations, the demo
# corpus built in the test's directory, the optional flags at their first choice, and the failure
# schedule written by the README's own `megatron-recover schedule` command.
SCALE = [("-np 8", "-np 2"), ("--global-batch-size 32", "--global-batch-size 4"),
         ("--train-iters 100", "--train-iters 2"), ("data/", "{tmp}/data/"),
         ("runs/job/", "{tmp}/job/"), ("faults.yaml", "{tmp}/faults.yaml"),
         ("static|adaptive", "static"), ("exact|reserve", "exact"), ("[", ""), ("]", ""),
         ("--replicas R", "--replicas 2"), ("--seed S", "--seed 1"), ("--count K", "--count 1"),
         ("--iterations A:B", "--iterations 1:2")]

# README command -> ("run", what to run, scaled), ("long", the same, run by `make test-long`
# rather than `make test`) or ("skip", why it does not run here).
COMMANDS = {
    "make demo": ("long", ".venv/bin/python scripts/demo.py --replicas 4 --iterations 6 "
                         "--out {tmp}/demo"),
    "make demo-bf16": ("long", ".venv/bin/python scripts/demo.py --replicas 4 --iterations 6 "
                               "--precision bf16 --out {tmp}/demo-bf16"),
    "scripts/demo.py --precision bf16\\|fp16\\|fp32": ("skip", "the synopsis of make demo-bf16"),
    "make demo-collective": ("run", ".venv/bin/python scripts/demo_collective.py --ranks 3 "
                                    "--steps 4 --kill-step 2"),
    "make test": ("skip", "this suite itself"),
    "make test-long": ("skip", "this suite's checks marked long"),
    "make test-slurm": ("skip", "this suite's checks marked slurm (root, apt-get)"),
    "sbatch --nodes 3 --ntasks-per-node 2 configs/slurm_recover.sbatch --recover "
    "--recover-snapshot-interval 2 ARGS": ("skip", "the command tests/test_slurm.py submits "
                                                   "(make test-slurm)"),
    "make test-unit": ("skip", "the unit tier, which this suite runs itself"),
    "make setup": ("run", "make setup"),
    "make build": ("run", "make build"),
    "make PYTHON=/path/to/python3.12": ("skip", "a placeholder path; make setup above runs with "
                                                "the Python 3.12 scripts/find_python.sh finds"),
    "make build MPI_HOME=/opt/ompi": ("skip", "needs a site Open MPI installed at /opt/ompi"),
    "make mutations": ("skip", "tests/test_ledger_mutations.py runs its data-path mutations end "
                               "to end, tests/unit/test_mutations.py the others in process"),
    "make fault-campaign N=30 SEED=1": ("long", "make fault-campaign N=1 SEED=5 "
                                               "OUT={tmp}/campaign"),
    "make fault-campaign": ("skip", "the target of the command above"),
    "make bench": ("long", ".venv/bin/python scripts/bench_collective.py --reps-scale 0.05"),
    "make bench-restart": ("skip", "about 45 minutes; tests/test_bench_vs_restart.py checks its "
                                   "accounting, tests/test_stock_fail_stop.py its baseline"),
    "make goodput": ("run", ".venv/bin/megatron-recover goodput --gpus 1000,4000 --runs 1 "
                            "--days 2 --plot {tmp}/ettr.png --json"),
    "megatron-recover goodput": ("skip", "the name of the commands below"),
    "megatron-recover goodput --validate --json": ("long", ".venv/bin/megatron-recover goodput "
                                                          "--validate --json"),
    "megatron-recover goodput --validate": ("skip", "as --validate --json above"),
    "scripts/bench_vs_restart.py --json": ("skip", "as make bench-restart"),
    "make bench-scale": ("skip", "6 minutes and 14 GiB; tests/test_bench_scale.py runs it scaled"),
    "scripts/bench_scale.py --json": ("skip", "as make bench-scale"),
    "make bench-grow-back": ("long", ".venv/bin/python scripts/bench_grow_back.py --replicas 3 "
                                    "--failures 1 --iterations 5 --out {tmp}/grow-back"),
    "scripts/bench_grow_back.py --json": ("skip", "as make bench-grow-back"),
    # The fake nodes hide /tmp: the output goes under runs/, which they see.
    "make bench-node-loss": ("long", ".venv/bin/python scripts/bench_node_loss.py --iterations 12 "
                                     "--interval 2 --pairs 1 --out runs/readme-node-loss"),
    "scripts/bench_node_loss.py --json": ("skip", "as make bench-node-loss"),
    "scripts/bench_node_loss.py --json --only overhead --pairs 3":
        ("skip", "the overhead half of make bench-node-loss, which runs above"),
    "make bench-interleaved": ("long", ".venv/bin/python scripts/bench_interleaved.py "
                                       "--repeats 1 --out {tmp}/interleaved"),
    "make bench-sdc": ("long", ".venv/bin/python scripts/bench_sdc.py --json --rates 0,1 "
                               "--trials 2 --flips 20 --ranks 2 --iterations 7"),
    "scripts/bench_sdc.py --json --rounds 2": ("skip", "the command make bench-sdc runs, above"),
    "scripts/bench_sdc.py --json": ("skip", "as make bench-sdc"),
    ".venv/bin/megatron-recover launch --hostfile hosts --spare-hosts node9 --max-relaunches 2 "
    "-- .venv/bin/python pretrain_gpt_recover.py ARGS --recover --recover-snapshot-interval 10":
        ("skip", "needs several hosts; tests/test_node_loss.py runs the same launcher on fake "
                 "nodes"),
    "scripts/bench_collective.py --json": ("long", ".venv/bin/python scripts/bench_collective.py "
                                                   "--json --reps-scale 0.2"),
    "scripts/bench_overhead.py --json --size compute --ranks 2 --modes stock,deferred,overlapped "
    "--precisions fp32 --iterations 12 --rounds 2": ("long", ".venv/bin/python "
                                                    "scripts/bench_overhead.py --json --size "
                                                    "compute --ranks 2 --modes stock,overlapped "
                                                    "--precisions fp32 --iterations 6 --rounds 1"),
    "scripts/bench_overhead.py --json --size compute --ranks 2 --modes stock,overlapped,"
    "overlapped-mpi --precisions fp32 --iterations 12 --rounds 2": (
        "long", ".venv/bin/python scripts/bench_overhead.py --json --size compute --ranks 2 "
                "--modes overlapped,overlapped-mpi --precisions fp32 --iterations 6 --rounds 1"),
    "scripts/bench_overhead.py --json --size mid --ranks 2 --modes stock,deferred,overlapped "
    "--precisions bf16 --iterations 12 --rounds 2": ("long", ".venv/bin/python "
                                                    "scripts/bench_overhead.py --json --size mid "
                                                    "--ranks 2 --modes stock,overlapped "
                                                    "--precisions bf16 --iterations 6 --rounds 1"),
    "scripts/bench_overhead.py --json": ("long", ".venv/bin/python scripts/bench_overhead.py "
                                                 "--json --ranks 2 --iterations 7 --rounds 1"),
    "scripts/bench_straggler.py --json": ("long", ".venv/bin/python scripts/bench_straggler.py "
                                                  "--json --iterations 10 --rounds 1 "
                                                  "--microbatches 4"),
    "megatron-recover plan --w-init 4 --g-init 4 --iterations 10 --slow 2:3@3-7 "
    "--straggler-threshold 0.25 --straggler-window 2":
        ("run", ".venv/bin/megatron-recover plan --w-init 4 --g-init 4 --iterations 10 "
                "--slow 2:3@3-7 --straggler-threshold 0.25 --straggler-window 2"),
    "megatron-recover plan --w-init 32 --g-init 8 --iterations 5 --fail 1:31 --json":
        ("run", ".venv/bin/megatron-recover plan --w-init 32 --g-init 8 --iterations 5 "
                "--fail 1:31 --json"),
    "megatron-recover schedule --replicas R --seed S --count K --iterations A:B -o faults.yaml":
        ("run", "scaled"),
    "mpirun --with-ft ulfm -np 8 .venv/bin/python pretrain_gpt_recover.py --num-layers 2 "
    "--hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 1 "
    "--global-batch-size 32 --train-iters 100 --lr 3e-3 --data-path data/corpus_text_document "
    "--split 100,0,0 --tokenizer-type GPT2BPETokenizer --vocab-file data/vocab.json "
    "--merge-file data/merges.txt --recover --recover-log runs/job/log.jsonl "
    "[--recover-policy static|adaptive] [--recover-mode exact|reserve] "
    "[--recover-failure-schedule faults.yaml]": ("run", "scaled"),
    "mpirun --with-ft ulfm": ("skip", "a fragment of the pretrain command"),
    ".venv/bin/megatron-recover launch -n 4 -- .venv/bin/python my_job.py":
        ("run", ".venv/bin/megatron-recover launch -n 2 -- .venv/bin/python {tmp}/my_job.py"),
    "megatron-recover launch": ("skip", "the name of the command above"),
    "megatron-recover schedule": ("skip", "the name of the schedule command above"),
    "git clone https://github.com/NVIDIA/Megatron-LM && cd Megatron-LM && git checkout "
    "core_v0.19.0": ("skip", "needs github.com; make setup applies the same patches to the "
                             "verified sdist"),
    'for p in /path/to/megatron-recover/patches/*.patch; do patch -p1 --forward < "$p" || '
    "break; done": ("skip", "applies to that checkout; make setup applies the same patches"),
    "pip install --no-deps --no-build-isolation .": ("skip", "installs that checkout"),
    "configs/gpt3_recover.sh": ("skip", "8 ranks for about 2 minutes; tests/test_configs.py runs "
                                        "its command line through the start-up checks, and "
                                        "tests/test_evaluation_logging.py the same failures"),
    "sbatch --nodes 5 --ntasks-per-node 8 configs/slurm_recover.sbatch --recover "
    "--recover-snapshot-interval 10 ARGS": ("skip", "needs a Slurm cluster: make test-slurm "
                                                    "runs the script under one (tests/"
                                                    "test_slurm.py), tests/test_configs.py its "
                                                    "dry run"),
    "mpirun --with-ft ulfm -np 6 --host $(hostname):2,nodeB:2,nodeC:2 --map-by ppr:2:node "
    "--prtemca plm_ssh_agent /abs/fake_ssh.sh --prtemca oob_tcp_if_include 10.77.0.0/24 --mca "
    "btl_tcp_if_include 10.77.0.0/24 --mca mpi_yield_when_idle 1 /abs/.venv/bin/python "
    "script.py": ("skip", "the line megatron_recover.testing.nodes composes; "
                          "tests/test_node_loss.py runs it on fake nodes"),
    "mpirun --with-ft ulfm -np N .venv/bin/python pretrain_gpt_recover.py":
        ("skip", "the form of the training command, which docs/training.md shows in full"),
    "megatron-recover launch --hostfile": ("skip", "names the option; the relaunching launcher's "
                                                   "command in full is the entry above"),
    "make fault-campaign N=30 SEED=2026": ("skip", "the recorded 30-case run (about 10 minutes); "
                                                   "make fault-campaign N=30 SEED=1 runs one case "
                                                   "of it"),
    "make fault-campaign N=30 SEED=20261208": ("skip", "the recorded 30-case run on "
                                                       "megatron-core 0.19 (about 23 minutes); "
                                                       "make fault-campaign N=30 SEED=1 runs one "
                                                       "case of it"),
    "make fault-campaign N=30 SEED=20261209": ("skip", "the recorded 30-case run of the "
                                                       "final 0.19 port (about 16 minutes); "
                                                       "make fault-campaign N=30 SEED=1 runs one "
                                                       "case of it"),
    "make fault-campaign N=30 SEED=20261210 PLANE=torch": ("skip", "the earlier recorded run "
                                                                   "on the torch data plane "
                                                                   "(about 25 minutes); the "
                                                                   "test-long slice runs it on "
                                                                   "both planes"),
    "make fault-campaign N=30 SEED=20261211 PLANE=torch": ("skip", "the recorded 30-case run "
                                                                   "on the torch data plane "
                                                                   "(about 17 minutes); the "
                                                                   "test-long slice runs it on "
                                                                   "both planes"),
    "mpirun --with-ft ulfm --oversubscribe -np N": ("skip", "a fragment: how the measured "
                                                            "facts were launched"),
    "mpirun --dvm": ("skip", "names an mpirun mode the facts page rules out"),
    ".venv/bin/python scripts/tensorboard_tags.py runs/gpt3/tensorboard":
        ("skip", "reads the run above; tests/test_evaluation_logging.py runs it on its own run"),
    "DRY_RUN=1 scripts/install_deps.sh python3 /tmp/venv":
        ("run", "DRY_RUN=1 scripts/install_deps.sh python3 {tmp}/venv"),
    "TORCH=pinned DRY_RUN=1 scripts/install_deps.sh python3 /tmp/venv":
        ("run", "TORCH=pinned DRY_RUN=1 scripts/install_deps.sh python3 {tmp}/venv"),
    'docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm -it -v '
    '"$PWD":/work -w /work nvcr.io/nvidia/pytorch:<yy.mm>-py3':
        ("skip", "needs Docker, a GPU and NVIDIA's container"),
    "mkdir wheels": ("skip", "prepares the offline wheel directory on a networked machine"),
    "grep -v '^torch==' requirements.txt > wheels/requirements-less-torch.txt":
        ("skip", "prepares the offline wheel directory; tests/test_install.py checks that the "
                 "system-torch install leaves out the same line"),
    "pip download --dest wheels --python-version 3.12 --only-binary :all: --platform "
    "manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -r wheels/requirements-less-torch.txt":
        ("skip", "downloads the cp312 wheels (network, hundreds of MB)"),
    "pip download --dest wheels --no-binary :all: --no-deps megatron-core==0.19.0":
        ("skip", "needs the network; make setup fetches the same sdist and checks its sha256"),
    "sha256sum wheels/megatron_core-0.19.0.tar.gz":
        ("skip", "checks the file downloaded above"),
    "make setup WHEELS=wheels":
        ("skip", "needs the wheel directory above; tests/test_install.py runs make setup "
                 "WHEELS=dir with a fake python, and the offline megatron-core build with pip"),
    "make gpu-check": ("skip", "needs an NVIDIA GPU; tests/test_gpu_check.py runs its dry run "
                               "here, which stops on a machine without one"),
}


def readme_commands() -> list[str]:
    """The commands of the README and of the docs/ pages, in order, each once."""
    text = "\n".join(page.read_text() for page in [README, *sorted(DOCS.glob("*.md"))])
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(" ".join(line.split()))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if span.startswith(STARTS) and " " in span:
            commands.append(span)
    return list(dict.fromkeys(commands))


def test_every_readme_command_has_an_entry():
    missing = [c for c in readme_commands() if c not in COMMANDS]
    assert not missing, f"README commands this test does not know how to run: {missing}"
    stale = [c for c in COMMANDS if c not in readme_commands()]
    assert not stale, f"entries for commands the README no longer shows: {stale}"


def scaled(command: str, tmp: Path) -> str:
    for old, new in SCALE:
        command = command.replace(old, new.format(tmp=tmp))
    return command


def run(command: str, tmp: Path) -> str:
    env = dict(os.environ, PATH=f"{VENV}:{os.environ['PATH']}")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    rc, output, _ = run_bounded(["bash", "-c", f"cd {shlex.quote(str(ROOT))} && {command}"],
                                env, TIMEOUT_S)
    assert rc == 0, f"{command}\nexit {rc}\n{output[-4000:]}"
    return output


RUNNABLE = [pytest.param(c, marks=[pytest.mark.long] if kind == "long" else [])
            for c, (kind, how) in COMMANDS.items() if kind in ("run", "long") and how != "scaled"]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("command", RUNNABLE)
def test_readme_command_runs(tmp_path, command):
    (tmp_path / "my_job.py").write_text("print('my job ran')\n")
    output = run(COMMANDS[command][1].format(tmp=tmp_path), tmp_path)
    if "launch" in command:
        assert output.count("my job ran") == 2 and "run succeeded" in output
    if "fault-campaign" in command:
        assert '"cases_passed": 1' in output and '"failed_cases": []' in output


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_readme_training_command_with_its_failure_schedule(tmp_path):
    """The README's schedule command writes faults.yaml; its pretrain command trains with it."""
    run(f".venv/bin/python scripts/make_demo_corpus.py --output-dir {tmp_path}/data", tmp_path)
    schedule, pretrain = (c for c, (_, how) in COMMANDS.items() if how == "scaled")
    run(scaled(schedule, tmp_path).replace("megatron-recover", ".venv/bin/megatron-recover"),
        tmp_path)
    assert "entries" in (tmp_path / "faults.yaml").read_text()
    output = run(scaled(pretrain, tmp_path).replace("mpirun", f"{VENV}/mpirun"), tmp_path)
    records = (tmp_path / "job/log.jsonl").read_text().splitlines()
    assert len(records) == 2 and "stops on an error" not in output, output[-3000:]
    assert (tmp_path / "job/log.markers.jsonl").exists(), output[-3000:]  # the failure fired
