"""pretrain_gpt_recover.py stops at start-up, with a message saying what to change, on bad input.

Run: `make test`. CPU only; each case is a 2-rank mpirun under a hard timeout. The run must end
(no hang), record an error in the rank status files, and rank 0 must print the message once.
The last case: what a killed mpirun leaves behind must not stop the next one at start-up.
"""

import shlex
import shutil
import socket

import pytest

from megatron_recover.launch import (LaunchConfig, Started, launch, launch_env, mpirun_command,
                                     run_bounded)
from tests.mpirun_harness import ENTRY

pytestmark = pytest.mark.mpi
TIMEOUT_S = 120
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
       "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", "128"]


def refused(tmp_path, extra, expected):
    result = launch(LaunchConfig(2, [*ENTRY, *JOB, *extra], tmp_path / "status", TIMEOUT_S))
    assert not result.timed_out and not result.succeeded, result.output[-3000:]
    assert {s["state"] for s in result.statuses.values()} == {"error"}
    assert result.output.count("megatron-recover: error:") == 1, result.output[-3000:]
    assert expected in result.output, result.output[-3000:]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("replica, location, expected", [
    (9, "during-reduce", "replica 9 does not exist"),
    # make test's budget: tests/test_schedule.py checks every refusal without a job.
    pytest.param(1, "in-the-optimizer", "location 'in-the-optimizer' is not one of",
                 marks=pytest.mark.long),
])
def test_schedule_naming_what_does_not_exist(tmp_path, replica, location, expected):
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(f"entries:\n  - {{iteration: 1, replica: {replica}, local_rank: 0, "
                        f"location: {location}}}\n")
    refused(tmp_path, ["--recover", "--recover-failure-schedule", str(schedule)], expected)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_forced_overflow_needs_fp16(tmp_path):
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("entries: []\noverflows:\n  - {iteration: 1, microbatch_id: 0}\n")
    refused(tmp_path, ["--bf16", "--recover", "--recover-failure-schedule", str(schedule)],
            "add --fp16 or drop 'overflows'")


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_global_batch_not_divisible(tmp_path):
    refused(tmp_path, ["--global-batch-size", "3", "--recover"], "--global-batch-size")


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_full_distributed_optimizer_across_replicas(tmp_path):
    # Without instances, --use-distributed-optimizer under --recover is one instance per
    # replica; one instance spanning the replicas is what cannot survive.
    refused(tmp_path, ["--recover", "--use-distributed-optimizer",
                       "--num-distributed-optimizer-instances", "1"],
            "shards optimizer state across replicas")


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_recover_without_ulfm(tmp_path):
    """mpirun without --with-ft ulfm: stop before training, saying how to relaunch."""
    cfg = LaunchConfig(2, [*ENTRY, *JOB, "--recover"], tmp_path / "status", TIMEOUT_S)
    cfg.status_dir.mkdir(parents=True)
    rc, output, _ = run_bounded(mpirun_command(cfg, fault_tolerant=False), launch_env(cfg),
                                TIMEOUT_S)
    assert rc is not None, output[-3000:]
    assert "relaunch with `mpirun --with-ft ulfm" in output, output[-3000:]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_fatal_error_reaches_the_terminal_under_plain_mpirun(tmp_path):
    """An error every rank hits during training (here a program error the failure schedule
    raises in both replicas' backward, each taking only its own rank down) kills every rank; a
    plain `mpirun` user has no status files, so each rank's message must be on the terminal."""
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("entries:\n"
                        "  - {iteration: 2, replica: 0, local_rank: 0, location: backward, "
                        "action: raise}\n"
                        "  - {iteration: 2, replica: 1, local_rank: 0, location: backward, "
                        "action: raise}\n")
    cfg = LaunchConfig(2, [*ENTRY, *JOB, "--recover", "--recover-program-errors", "survive",
                           "--recover-failure-schedule", str(schedule)], tmp_path / "status",
                       TIMEOUT_S)
    cfg.status_dir.mkdir(parents=True)
    rc, output, _ = run_bounded(mpirun_command(cfg), launch_env(cfg), TIMEOUT_S)
    assert rc is not None, output[-3000:]
    for rank in (0, 1):
        assert f"megatron-recover: rank {rank} stops on an error:" in output, output[-3000:]
    assert output.count("InjectedError: failure schedule: a program error at backward of "
                        "iteration 2") == 2, output[-3000:]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_killed_mpirun_never_stops_a_later_one_at_start_up(tmp_path):
    """A SIGKILLed mpirun leaves its PMIx rendezvous files in <tmpdir>/ompi.<its PID>; an mpirun
    that later gets that PID stops at once (CI saw it with pid_max 32768). The launcher removes
    them once it has reaped the mpirun it started."""
    cfg = LaunchConfig(1, ["sh", "-c", "kill -KILL $PPID"], tmp_path / "status", TIMEOUT_S)
    env = {**launch_env(cfg), "TMPDIR": str(tmp_path)}
    killed = Started(mpirun_command(cfg, fault_tolerant=False), env)
    assert killed.wait(TIMEOUT_S) and killed.proc.returncode == -9, killed.output
    left = tmp_path / f"ompi.{killed.proc.pid}"
    assert (left / f"pmix.{socket.gethostname()}.tool.{killed.proc.pid}").exists()
    stale = shutil.copytree(left, tmp_path / "stale")
    killed.stop()
    assert not left.exists()

    # What they did to the next mpirun of that PID (`exec` keeps the shell's PID).
    command = shlex.join(mpirun_command(LaunchConfig(1, ["true"], cfg.status_dir), False))
    rc, output, _ = run_bounded(
        ["sh", "-c", f'cp -a {shlex.quote(str(stale))} "$TMPDIR/ompi.$$" && exec {command}'],
        env, TIMEOUT_S)
    assert rc == 213 and "listener thread failed to start" in output, (rc, output)
