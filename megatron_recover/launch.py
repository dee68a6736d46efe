"""Run a command under `mpirun --with-ft ulfm` and judge the outcome: the layer under
`megatron-recover launch` (its command line is launch_cli.py; relaunch.py, built on this module,
comes back from a lost node).

mpirun's own exit status says nothing about failures (0 after SIGKILLed ranks, and a rank that
exits non-zero is never reported), so every rank of ours writes a status file
(`runtime.write_status`) and the launcher decides from those: the run succeeded when at least one
rank completed and none recorded an error. Ranks killed on purpose (fault injection) or by a
crash write no `completed`; the job is judged by the survivors.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil


LAUNCH_DEFAULTS = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# What the ranks' entry point reads (pretrain_gpt_recover.py).
STATUS_DIR_ENV = "MEGATRON_RECOVER_STATUS_DIR"
RUN_ID_ENV = "MEGATRON_RECOVER_RUN_ID"  # one per job, kept by its relaunches (snapshots)
NETWORK_ENV = "MEGATRON_RECOVER_NETWORK"  # --if-include: the network the ranks rendezvous on
SNAPSHOT_ROOT = Path("/dev/shm")


def default_snapshot_dir(run_id: str) -> Path:
    """Where the ranks of job `run_id` keep their snapshots unless --recover-snapshot-dir."""
    return SNAPSHOT_ROOT / f"megatron-recover-{run_id}"


FORWARDED_ENV = ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONPATH", STATUS_DIR_ENV, RUN_ID_ENV,
                 NETWORK_ENV)


@dataclass(frozen=True)
class LaunchConfig:
    """How to start the job."""

    num_ranks: int
    command: list[str]
    status_dir: Path
    timeout_s: float = 3600.0
    mpirun: str | None = None  # default: the mpirun beside this Python
    hosts: tuple[str, ...] = ()  # several hosts: ranks_per_host consecutive ranks on each
    ranks_per_host: int = 0
    ssh_agent: str | None = None  # PRRTE's remote launcher instead of ssh (plm_ssh_agent)
    network: str | None = None  # CIDR of the hosts' network (MPI's and gloo's interface)
    run_id: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # more environment for mpirun and its agents


def mpirun_command(cfg: LaunchConfig, fault_tolerant: bool = True) -> list[str]:
    """The full mpirun line: ULFM on (unless `fault_tolerant` is False, to show what a plain
    launch does), the hosts, oversubscription when ranks exceed this machine's cores, idle ranks
    yield."""
    mpirun = cfg.mpirun or str(Path(sys.executable).parent / "mpirun")
    cmd = [mpirun, *(["--with-ft", "ulfm"] if fault_tolerant else []), "-np", str(cfg.num_ranks)]
    if cfg.hosts:
        n = cfg.ranks_per_host
        cmd += ["--host", ",".join(f"{host}:{n}" for host in cfg.hosts),
                "--map-by", f"ppr:{n}:node"]
    if cfg.ssh_agent:
        cmd += ["--prtemca", "plm_ssh_agent", cfg.ssh_agent]
    if cfg.network:
        cmd += ["--prtemca", "oob_tcp_if_include", cfg.network,
                "--mca", "btl_tcp_if_include", cfg.network]
    if cfg.num_ranks > (os.cpu_count() or 1):
        cmd += ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
    # One compute thread per rank; the status directory reaches the ranks' entry points.
    env = launch_env(cfg)
    for var in FORWARDED_ENV:
        if var in env:
            cmd += ["-x", var]
    return cmd + list(cfg.command)


def launch_env(cfg: LaunchConfig) -> dict[str, str]:
    env = dict(os.environ, **LAUNCH_DEFAULTS, **dict(cfg.env))
    env[STATUS_DIR_ENV] = str(cfg.status_dir)
    if cfg.run_id:
        env[RUN_ID_ENV] = cfg.run_id
    if cfg.network:
        env[NETWORK_ENV] = cfg.network
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


@dataclass
class RunResult:
    returncode: int | None  # None: killed on timeout
    output: str
    elapsed_s: float
    statuses: dict[int, dict]
    lines: list[tuple[float, str]] = field(default_factory=list)  # (time.time() on arrival, line)

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def succeeded(self) -> bool:
        states = [s.get("state") for s in self.statuses.values()]
        return not self.timed_out and "completed" in states and "error" not in states


def program_error(statuses: dict[int, dict]) -> tuple[int, dict] | None:
    """(rank, status) of the rank whose program error ended the job (megatron_recover.errors:
    it stops its Open MPI daemon instead of leaving), or None."""
    for rank, status in sorted(statuses.items()):
        if status.get("ended_job"):
            return rank, status
    return None


def read_statuses(status_dir: Path) -> dict[int, dict]:
    statuses = {}
    for path in sorted(Path(status_dir).glob("rank-*.json")):
        statuses[int(path.stem.split("-")[1])] = json.loads(path.read_text())
    return statuses


def _tmpdir(env: dict[str, str]) -> Path:
    """The directory mpirun (PRRTE) keeps its session in, for the environment it ran with."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        if env.get(name):
            return Path(env[name])
    return Path("/tmp")


def remove_session_dir(pid: int, env: dict[str, str]) -> None:
    """Remove the session directory of mpirun `pid`, which has exited and been reaped.

    mpirun keeps its PMIx rendezvous files in <tmpdir>/ompi.<its PID> and removes them when it
    exits cleanly; a SIGKILLed one leaves them. A later mpirun that gets the same PID (pid_max is
    32768 here; a test suite starts many thousands of processes) then finds them and stops at
    once: "The PMIx server's listener thread failed to start" (exit 213)."""
    shutil.rmtree(_tmpdir(env) / f"ompi.{pid}", ignore_errors=True)


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


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


class Started:
    """`cmd` running in its own process group, its output read line by line.

    Each line is kept with the time.time() of its arrival (`lines`); `on_line(time, line)`, if
    given, runs in the reader thread for each, and `echo` copies them to stdout.
    """

    def __init__(self, cmd: list[str], env: dict[str, str], on_line=None, echo: bool = False):
        self.started = time.time()
        self._start = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self._on_line, self._echo = on_line, echo
        self._env = env
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.time()
            self.lines.append((now, line))
            if self._echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            if self._on_line is not None:
                self._on_line(now, line)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._start

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def wait(self, timeout_s: float, poll=None) -> bool:
        """Wait up to `timeout_s` for the command to exit (True if it did); `poll()`, if
        given, runs every POLL_S seconds meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return self.proc.poll() is not None
            try:
                self.proc.wait(timeout=min(POLL_S, left))
                return True
            except subprocess.TimeoutExpired:
                if poll is not None:
                    poll()

    def stop(self) -> None:
        """Stop it (and its process group) if it still runs; collect the last output. Its
        descendants in other process groups (mpirun's remote launchers, ssh or a stand-in)
        are stopped too, by PID."""
        descendants = _descendants(self.proc.pid)
        _stop(self.proc)  # also the group's members that outlived mpirun
        self.proc.wait()
        remove_session_dir(self.proc.pid, self._env)
        for child in descendants:
            try:
                child.kill()
            except psutil.Error:  # gone already
                pass
        self._reader.join(timeout=5.0)


def run_bounded(cmd: list[str], env: dict[str, str], timeout_s: float,
                stream: bool = False, poll=None) -> tuple[int | None, str, float]:
    """Run `cmd` in its own process group; on timeout (or if we are interrupted) stop it.
    `poll()`, if given, runs every POLL_S seconds while `cmd` runs.

    Returns (returncode, or None on timeout; combined output; elapsed seconds).
    """
    started = Started(cmd, env, echo=stream)
    exited = False
    try:
        exited = started.wait(timeout_s, poll)
    finally:
        started.stop()
    return (started.proc.returncode if exited else None), started.output, started.elapsed_s


def kill_process_group(pid: int) -> None:
    """SIGKILL the process group led by `pid` (mpirun starts each rank in its own, with the
    rank's helper processes), or only `pid` if it leads none: never a group we did not start."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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


class RunningJob(Started):
    """mpirun of `cfg`, started now (`fault_tolerant`: with ULFM on), for a caller that acts
    on it while it runs: kill a chosen rank (`kill_rank`), read the ranks' PIDs."""

    def __init__(self, cfg: LaunchConfig, fault_tolerant: bool = True, on_line=None,
                 echo: bool = False):
        self.cfg = cfg
        cfg.status_dir.mkdir(parents=True, exist_ok=True)
        for stale in cfg.status_dir.glob("rank-*.json"):
            stale.unlink()
        super().__init__(mpirun_command(cfg, fault_tolerant), launch_env(cfg), on_line, echo)

    def rank_pids(self) -> dict[int, int]:
        return {rank: s["pid"] for rank, s in read_statuses(self.cfg.status_dir).items()
                if "pid" in s}

    def kill_rank(self, rank: int) -> int:
        """SIGKILL world rank `rank` with its helpers (a node going down); returns its PID."""
        pid = self.rank_pids()[rank]
        kill_process_group(pid)
        return pid

    def kill_everything(self) -> None:
        """mpirun's process group and every rank's, whatever state they are in."""
        pids = self.rank_pids()
        self.stop()
        for pid in pids.values():
            kill_process_group(pid)


def launch(cfg: LaunchConfig, stream: bool = False, on_line=None, poll=None,
           fault_tolerant: bool = True) -> RunResult:
    """Run the job to completion or its timeout; never leaves a process of it behind.
    `on_line(time, line)` sees each output line as it arrives, `poll()` runs every POLL_S."""

    def every_poll():
        reap_frozen_ranks(cfg.status_dir)
        if poll is not None:
            poll()

    job = RunningJob(cfg, fault_tolerant, on_line, stream)
    exited = False
    try:
        exited = job.wait(cfg.timeout_s, every_poll)
    finally:
        job.stop()
        if not exited:  # timed out or interrupted: mpirun may have left ranks behind
            kill_ranks(read_statuses(cfg.status_dir))
    return RunResult(job.proc.returncode if exited else None, job.output, job.elapsed_s,
                     read_statuses(cfg.status_dir), list(job.lines))
