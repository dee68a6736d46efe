"""`megatron-recover launch`: run a command under `mpirun --with-ft ulfm` and judge the outcome.

mpirun's own exit status says nothing about failures (0 after SIGKILLed ranks, and a rank that
exits non-zero is never reported), so every rank of ours writes a status file
(`runtime.write_status`) and the launcher decides from those: the run succeeded when at least one
rank completed and none recorded an error. Ranks killed on purpose (fault injection) or by a
crash write no `completed`; the job is judged by the survivors.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path


LAUNCH_DEFAULTS = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
FORWARDED_ENV = ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONPATH", "MEGATRON_RECOVER_STATUS_DIR")


@dataclass(frozen=True)
class LaunchConfig:
    """How to start the job."""

    num_ranks: int
    command: list[str]
    status_dir: Path
    timeout_s: float = 3600.0
    mpirun: str | None = None  # default: the mpirun beside this Python


def mpirun_command(cfg: LaunchConfig, fault_tolerant: bool = True) -> list[str]:
    """The full mpirun line: ULFM on (unless `fault_tolerant` is False, to show what a plain
    launch does), oversubscription when ranks exceed cores, idle ranks yield."""
    mpirun = cfg.mpirun or str(Path(sys.executable).parent / "mpirun")
    cmd = [mpirun, *(["--with-ft", "ulfm"] if fault_tolerant else []), "-np", str(cfg.num_ranks)]
    if cfg.num_ranks > (os.cpu_count() or 1):
        cmd += ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
    # One compute thread per rank; the status directory reaches the ranks' entry points.
    env = launch_env(cfg)
    for var in FORWARDED_ENV:
        if var in env:
            cmd += ["-x", var]
    return cmd + list(cfg.command)


def launch_env(cfg: LaunchConfig) -> dict[str, str]:
    env = dict(os.environ, **LAUNCH_DEFAULTS, MEGATRON_RECOVER_STATUS_DIR=str(cfg.status_dir))
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


@dataclass
class RunResult:
    returncode: int | None  # None: killed on timeout
    output: str
    elapsed_s: float
    statuses: dict[int, dict]

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def succeeded(self) -> bool:
        states = [s.get("state") for s in self.statuses.values()]
        return not self.timed_out and "completed" in states and "error" not in states


def read_statuses(status_dir: Path) -> dict[int, dict]:
    statuses = {}
    for path in sorted(Path(status_dir).glob("rank-*.json")):
        statuses[int(path.stem.split("-")[1])] = json.loads(path.read_text())
    return statuses


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop mpirun: SIGTERM lets it take its ranks down; then SIGKILL its process group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


POLL_S = 0.5


def run_bounded(cmd: list[str], env: dict[str, str], timeout_s: float,
                stream: bool = False, poll=None) -> tuple[int | None, str, float]:
    """Run `cmd` in its own process group; on timeout (or if we are interrupted) stop it.
    `poll()`, if given, runs every POLL_S seconds while `cmd` runs.

    Returns (returncode, or None on timeout; combined output; elapsed seconds).
    """
    start = time.monotonic()
    deadline = start + timeout_s
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    chunks = []
    reader = threading.Thread(target=_drain, args=(proc.stdout, chunks, stream), daemon=True)
    reader.start()
    timed_out = True
    try:
        while time.monotonic() < deadline:
            try:
                proc.wait(timeout=min(POLL_S, max(0.0, deadline - time.monotonic())))
                timed_out = False
                break
            except subprocess.TimeoutExpired:
                if poll is not None:
                    poll()
    finally:
        if proc.poll() is None:
            _stop(proc)
    reader.join(timeout=max(1.0, deadline - time.monotonic()))
    return (None if timed_out else proc.returncode), "".join(chunks), time.monotonic() - start


def _drain(pipe, chunks: list[str], echo: bool) -> None:
    for line in pipe:
        chunks.append(line)
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP: state T in /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def reap_frozen_ranks(status_dir: Path) -> None:
    """Once every rank that is not frozen has finished, SIGKILL the frozen ones.

    A frozen rank (SIGSTOP, a hung host) is declared failed by the survivors' failure detector
    and the run goes on without it, but the stopped process itself keeps mpirun waiting at the
    end. Only our own ranks, by the PIDs in their status files.
    """
    statuses = read_statuses(status_dir)
    running = [s["pid"] for s in statuses.values() if s.get("state") == "running"]
    frozen = [pid for pid in running if _stopped(pid)]
    if frozen and all(not _alive(pid) or pid in frozen for pid in running):
        for pid in frozen:
            os.kill(pid, signal.SIGKILL)


def kill_ranks(statuses: dict[int, dict]) -> None:
    """SIGKILL ranks that outlived their mpirun (ranks run in sessions of their own)."""
    for status in statuses.values():
        pid = status.get("pid")
        if pid and status.get("state") == "running":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def launch(cfg: LaunchConfig, stream: bool = False) -> RunResult:
    """Run the job to completion or its timeout; never leaves a process of it behind."""
    cfg.status_dir.mkdir(parents=True, exist_ok=True)
    for stale in cfg.status_dir.glob("rank-*.json"):
        stale.unlink()
    rc = None
    try:
        rc, output, elapsed = run_bounded(mpirun_command(cfg), launch_env(cfg), cfg.timeout_s,
                                          stream, poll=lambda: reap_frozen_ranks(cfg.status_dir))
    finally:
        if rc is None:  # timed out or interrupted: mpirun may have left ranks behind
            kill_ranks(read_statuses(cfg.status_dir))
    return RunResult(rc, output, elapsed, read_statuses(cfg.status_dir))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--num-ranks", type=int, required=True, help="MPI processes")
    parser.add_argument("--status-dir", type=Path, default=None,
                        help="where ranks write their status files (default: a temporary dir)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="hard limit, seconds")
    parser.add_argument("--mpirun", default=None, help="mpirun to use (default: the venv's)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program and its arguments")


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("megatron-recover launch: give the program after --", file=sys.stderr)
        return 2
    if args.num_ranks < 1:
        print("megatron-recover launch: --num-ranks must be >= 1", file=sys.stderr)
        return 2
    status_dir = args.status_dir or Path(tempfile.mkdtemp(prefix="megatron-recover-"))
    cfg = LaunchConfig(args.num_ranks, command, status_dir, args.timeout, args.mpirun)
    result = launch(cfg, stream=True)
    if result.statuses:
        succeeded = result.succeeded
        summary = {rank: s.get("state") for rank, s in result.statuses.items()}
        basis = f"rank states {summary}; status files in {status_dir}"
    else:
        # A program that does not use megatron_recover.runtime writes no status: mpirun's
        # exit status is all there is.
        succeeded = result.returncode == 0
        basis = f"no rank wrote a status file; mpirun exited with {result.returncode}"
    verdict = "succeeded" if succeeded else "FAILED"
    print(f"megatron-recover launch: run {verdict} in {result.elapsed_s:.1f}s"
          f"{' (timed out)' if result.timed_out else ''}; {basis}")
    if args.status_dir is None and succeeded:
        shutil.rmtree(status_dir, ignore_errors=True)
    return 0 if succeeded else 1
