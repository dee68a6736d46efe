"""`megatron-recover launch --hostfile H --max-relaunches N`: come back from a lost node.

A rank's death is survived in-step (ULFM) and never relaunches anything. A lost node is not:
Open MPI 5.0's runtime ends the whole job ~50 ms after it loses a node's daemon, and a node that
vanishes silently (link down) leaves the job hanging (docs/node-loss.md, "A lost node ends the
job" and "A silent node loss hangs"). The launcher therefore:

1. runs the job on the hosts, with a stall watchdog: a job whose lowest live rank has committed
   no iteration for `stall_timeout_s` (derived from --recover-hang-timeout: the in-job last
   resort plus one hang timeout) is stopped as hung, and one that mpirun keeps waiting for
   EXIT_GRACE_S after a rank completed training (a node that vanished silently) is stopped and
   judged by its ranks' statuses;
2. when the job ends without a rank completing, finds the lost hosts: the ones PRRTE reports it
   lost a daemon on, the ones its remote launcher (ssh, srun inside a Slurm allocation, or the
   --ssh-agent stand-in) cannot reach, and the ones where no rank of the job ever started;
3. relaunches on the remaining hosts plus spares (as many as were lost), at most
   --max-relaunches times, with the same run id: the ranks resume from the newest in-memory
   snapshot the surviving nodes hold in full (megatron_recover.megatron.persistence.snapshots), or from
   --load's checkpoint, with the static policy laid out again for the new replica count and B
   kept.

A job that ends with an error and no lost host (a bug, a bad argument) is not relaunched.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from megatron_recover.hang import DEFAULT_HANG_TIMEOUT_S, LAST_RESORT_FACTOR
from megatron_recover.launch import (
    RUN_ID_ENV,
    LaunchConfig,
    RunningJob,
    default_snapshot_dir,
    kill_ranks,
    program_error,
    read_statuses,
)

# prterun names the node in both of its messages for a lost daemon: "lost communication with a
# remote daemon" (Remote daemon: [...] on node NAME) and, when the remote launcher of the daemon
# exits first, "A daemon failed to report back" (Remote host: NAME).
_LOST_DAEMON = re.compile(r"Remote daemon:\s*\S+ on node (\S+)|Remote host:\s*(\S+)")
PROBE_TIMEOUT_S = 10.0
STALL_FACTOR = LAST_RESORT_FACTOR + 1  # past the in-job last resort
# Ranks that completed leave within their final consensus's timeout of each other
# (runtime.FINAL_CONSENSUS_TIMEOUT_S); a job still running this long after the first completed
# waits for what will not come.
EXIT_GRACE_S = 70.0


def read_hostfile(path: Path) -> list[tuple[str, int]]:
    """(host, slots) per line of an Open MPI hostfile (`host [slots=N]`, # comments)."""
    hosts = []
    for line in Path(path).read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        slots = 1
        for item in fields[1:]:
            key, _, value = item.partition("=")
            if key == "slots":
                slots = int(value)
        hosts.append((fields[0], slots))
    return hosts


def stall_timeout(command: list[str]) -> float:
    """The stall bound of a pretrain_gpt_recover.py command: STALL_FACTOR x its
    --recover-hang-timeout (its default when 0 turns the detector off: a silent node loss
    still hangs the job then)."""
    hang_s = DEFAULT_HANG_TIMEOUT_S
    for i, arg in enumerate(command):
        if arg == "--recover-hang-timeout" and i + 1 < len(command):
            hang_s = float(command[i + 1])
        elif arg.startswith("--recover-hang-timeout="):
            hang_s = float(arg.split("=", 1)[1])
    return STALL_FACTOR * (hang_s if hang_s > 0 else DEFAULT_HANG_TIMEOUT_S)


@dataclass(frozen=True)
class JobConfig:
    """A job on several hosts that a lost node does not end for good."""

    command: list[str]
    hosts: list[str]
    ranks_per_host: int
    status_root: Path  # attempt K's status files go to status_root/attempt-K
    spare_hosts: list[str] = field(default_factory=list)
    max_relaunches: int = 0
    timeout_s: float = 3600.0  # each attempt
    stall_timeout_s: float | None = None  # None: stall_timeout(command)
    ssh_agent: str | None = None
    network: str | None = None
    mpirun: str | None = None
    env: tuple[tuple[str, str], ...] = ()


# Open MPI's signal handler in a rank: this line, then the signal, its address and a backtrace.
SIGNAL_REPORT = "*** Process received signal ***"
SIGNAL_REPORT_LINES = 16


@dataclass
class Attempt:
    """One mpirun of the job and what ended it."""

    number: int
    hosts: list[str]
    run_id: str
    started: float  # time.time()
    ended: float = 0.0  # mpirun exited (or was stopped)
    returncode: int | None = None
    stalled: bool = False  # stopped by the watchdog: no committed iteration within the bound
    stopped_after_training: bool = False  # stopped by the watchdog: mpirun outlived training
    timed_out: bool = False
    statuses: dict[int, dict] = field(default_factory=dict)
    lost: dict[str, str] = field(default_factory=dict)  # host -> why it counts as lost
    lines: list[tuple[float, str]] = field(default_factory=list)
    unreachable: set[str] = field(default_factory=set)  # did not answer the ranks' clean-up

    @property
    def succeeded(self) -> bool:
        states = [s.get("state") for s in self.statuses.values()]
        return not (self.stalled or self.timed_out) and "completed" in states \
            and "error" not in states

    def silent_deaths(self) -> list[str]:
        """What mpirun printed of ranks that died without a status: the first signal report
        (Open MPI's handler prints the signal, the faulting address and a backtrace), then
        the last lines."""
        lines = [line for _, line in self.lines]
        first = next((i for i, line in enumerate(lines) if SIGNAL_REPORT in line), None)
        report = lines[first:first + SIGNAL_REPORT_LINES] if first is not None else []
        return report + (["..."] if report else []) + lines[-6:]

    def summary(self) -> str:
        states = {}
        for status in self.statuses.values():
            states[status.get("state")] = states.get(status.get("state"), 0) + 1
        how = ("stalled (no committed iteration within the bound)" if self.stalled else
               "stopped (mpirun still waited after training ended)"
               if self.stopped_after_training else
               "timed out" if self.timed_out else f"mpirun exited {self.returncode}")
        lost = ", ".join(f"{h} ({why})" for h, why in self.lost.items()) or "none"
        errors = "".join(f"\n  rank {rank} {s['state']}: {s['error'].strip().splitlines()[-1]}"
                         for rank, s in sorted(self.statuses.items())
                         if s.get("state") in ("error", "left") and s.get("error"))
        if not self.succeeded and not errors:  # ranks died without a word: mpirun's lines
            errors = "".join(f"\n  | {line.rstrip()}" for line in self.silent_deaths())
        return (f"attempt {self.number} on {','.join(self.hosts)}: {how} after "
                f"{self.ended - self.started:.1f} s; rank states {states}; lost hosts: {lost}"
                f"{errors}")


def remote_argv(host: str, command: str, ssh_agent: str | None, env: dict) -> list[str]:
    """The command line that runs shell `command` on `host`: through the --ssh-agent
    stand-in; inside a Slurm allocation, as a job step on that node (`srun --overlap`: beside
    the job's other steps; a site's compute nodes often refuse ssh); else through ssh."""
    if ssh_agent:
        return [ssh_agent, host, command]
    if env.get("SLURM_JOB_ID"):
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap",
                "--quiet", "--job-name=megatron-recover-probe", "/bin/sh", "-c", command]
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={PROBE_TIMEOUT_S:g}", host,
            command]


def remote(host: str, command: str, ssh_agent: str | None, env: dict) -> bool:
    """Run `command` on `host` through its remote launcher (`remote_argv`); whether it
    answered and succeeded within PROBE_TIMEOUT_S."""
    try:
        done = subprocess.run(remote_argv(host, command, ssh_agent, env), env=env,
                              capture_output=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def probe(host: str, ssh_agent: str | None, env: dict) -> bool:
    """Whether `host` answers its remote launcher (the local host always does)."""
    return host in (socket.gethostname(), "localhost") or remote(host, "true", ssh_agent, env)


def lost_hosts(attempt: Attempt, ranks_per_host: int, ssh_agent: str | None,
               env: dict) -> dict[str, str]:
    """The hosts of `attempt` to leave out of the next one, each with the evidence found."""
    evidence = {host: [] for host in attempt.hosts}
    output = "".join(line for _, line in attempt.lines)
    for host in (a or b for a, b in _LOST_DAEMON.findall(output)):
        if host in evidence and not evidence[host]:
            evidence[host].append("PRRTE lost its daemon")
    for index, host in enumerate(attempt.hosts):
        ranks = range(index * ranks_per_host, (index + 1) * ranks_per_host)
        # A host that did not answer the clean-up is not asked again: a lost one costs the
        # remote launcher's whole timeout each time.
        if host in attempt.unreachable or not probe(host, ssh_agent, env):
            evidence[host].append("unreachable")
        # Where no rank started at all, the job never started: that says nothing of a host.
        if attempt.statuses and not any(r in attempt.statuses for r in ranks):
            evidence[host].append("no rank started")
    return {host: ", ".join(found) for host, found in evidence.items() if found}


def read_progress(status_dir: Path) -> dict:
    """The newest committed iteration the ranks recorded ({"iteration", "time"}; {} before
    the first)."""
    try:
        return json.loads((status_dir / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def run_attempt(cfg: JobConfig, number: int, hosts: list[str], run_id: str, on_line=None,
                echo: bool = False, on_start=None) -> Attempt:
    """One mpirun of the job on `hosts`, bounded by cfg.timeout_s and the stall watchdog; every
    rank of it is gone when this returns (by mpirun's teardown, or by PID here)."""
    status_dir = cfg.status_root / f"attempt-{number}"
    launch = LaunchConfig(len(hosts) * cfg.ranks_per_host, cfg.command, status_dir, cfg.timeout_s,
                          cfg.mpirun, tuple(hosts), cfg.ranks_per_host, cfg.ssh_agent,
                          cfg.network, run_id, cfg.env)
    stall_s = cfg.stall_timeout_s if cfg.stall_timeout_s is not None else stall_timeout(
        cfg.command)
    attempt = Attempt(number, list(hosts), run_id, time.time())
    job = RunningJob(launch, on_line=on_line, echo=echo)
    if on_start is not None:
        on_start(attempt, job)

    def watchdog():
        now = time.time()
        done = [s["time"] for s in read_statuses(status_dir).values()
                if s.get("state") == "completed"]
        if done and now - min(done) > EXIT_GRACE_S:
            # Training is over, but mpirun still waits: for a node that vanished silently.
            attempt.stopped_after_training = True
            raise _Stalled
        last = read_progress(status_dir).get("time")
        if not done and last is not None and now - last > stall_s:
            attempt.stalled = True
            raise _Stalled

    exited = False
    try:
        exited = job.wait(cfg.timeout_s, watchdog)
    except _Stalled:
        pass
    finally:
        attempt.ended = time.time()
        job.stop()
        attempt.unreachable = end_ranks(read_statuses(status_dir), run_id, cfg.ssh_agent,
                                        {**os.environ, **dict(cfg.env)})
    attempt.timed_out = not (exited or attempt.stalled or attempt.stopped_after_training)
    attempt.returncode = job.proc.returncode if exited else None
    attempt.statuses = read_statuses(status_dir)
    attempt.lines = list(job.lines)
    return attempt


def end_ranks(statuses: dict[int, dict], run_id: str, ssh_agent: str | None,
              env: dict) -> set[str]:
    """SIGKILL the ranks of a stopped attempt that may still run, by the PIDs in their status
    files, each only if it is still a process of this job (its environment holds the run id: a
    PID may have been reused): here directly, on the other hosts through their remote launcher.
    mpirun ends without signalling the ranks on its own host when it loses a node, and a rank
    hung in a repair on another host may outlive a stopped mpirun; neither may compete with the
    relaunch. An unreachable host is a lost one, left out of the relaunch: returns the hosts
    that did not answer."""
    mark = f"{RUN_ID_ENV}={run_id}"
    unreachable = set()
    by_host: dict[str, list[int]] = {}
    for status in statuses.values():
        if status.get("state") == "running" and status.get("pid") and status.get("host"):
            by_host.setdefault(status["host"], []).append(status["pid"])
    for host, pids in by_host.items():
        if host == socket.gethostname():
            pids = [pid for pid in pids if mark.encode() in _environ(pid)]
            # Open MPI's shared-memory segments of ranks killed here outlive them (PRRTE, which
            # removes them at a normal end, is gone): the files these ranks map, removed after.
            segments = {line.split()[-1] for pid in pids for line in _maps(pid)
                        if line.split()[-1].startswith("/dev/shm/sm_segment.")}
            kill_ranks({pid: {"pid": pid, "state": "running"} for pid in pids})
            for path in segments:
                Path(path).unlink(missing_ok=True)
        elif not remote(host, f"for p in {' '.join(map(str, pids))}; do grep -qzx '{mark}' "
                              f"/proc/$p/environ 2>/dev/null && kill -KILL $p; done; true",
                        ssh_agent, env):
            unreachable.add(host)
    return unreachable


def _maps(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:  # gone already
        return []


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def remove_snapshots(run_id: str, hosts: list[str], cfg: JobConfig) -> None:
    """The job completed: free the memory its default snapshot directory holds on every host
    that still answers (the ranks remove their own files; those of ranks lost earlier stay)."""
    directory = default_snapshot_dir(run_id)
    env = {**os.environ, **dict(cfg.env)}
    for host in dict.fromkeys(hosts):
        if host == socket.gethostname():
            shutil.rmtree(directory, ignore_errors=True)
        else:
            remote(host, f"rm -rf {directory}", cfg.ssh_agent, env)


class _Stalled(Exception):
    pass


def run_job(cfg: JobConfig, on_line=None, echo: bool = False, on_start=None,
            log=print) -> list[Attempt]:
    """Run the job, relaunching after lost hosts (module docstring); returns every attempt.
    `on_start(attempt, job)` runs as each attempt's mpirun starts (benchmarks and tests kill
    nodes from there)."""
    run_id = uuid.uuid4().hex[:12]
    hosts, spares = list(cfg.hosts), list(cfg.spare_hosts)
    attempts = []
    while True:
        attempt = run_attempt(cfg, len(attempts) + 1, hosts, run_id, on_line, echo, on_start)
        attempts.append(attempt)
        if not attempt.succeeded:
            attempt.lost = lost_hosts(attempt, cfg.ranks_per_host, cfg.ssh_agent,
                                      {**os.environ, **dict(cfg.env)})
        log(f"megatron-recover launch: {attempt.summary()}")
        if attempt.succeeded:
            # A host found unreachable would only make each remote command wait its timeout.
            gone = {h for a in attempts for h, why in a.lost.items() if "unreachable" in why}
            gone |= {h for a in attempts for h in a.unreachable}
            remove_snapshots(run_id, [h for a in attempts for h in a.hosts if h not in gone],
                             cfg)
            return attempts
        if program_error(attempt.statuses) is not None:
            # It ended the job itself (stopping its daemon, which looks like a lost host), and
            # it would recur on any relaunch.
            log("megatron-recover launch: a program error ended the job: not relaunched")
            return attempts
        if not attempt.lost and not attempt.stalled:
            log("megatron-recover launch: the job failed without a lost host: not relaunched")
            return attempts
        if len(attempts) > cfg.max_relaunches:
            log(f"megatron-recover launch: --max-relaunches {cfg.max_relaunches} used up")
            return attempts
        hosts = [h for h in hosts if h not in attempt.lost]
        while spares and len(hosts) < len(cfg.hosts):
            hosts.append(spares.pop(0))
        if not hosts:
            log("megatron-recover launch: no host left to relaunch on")
            return attempts
        log(f"megatron-recover launch: relaunch {len(attempts)}/{cfg.max_relaunches} on "
            f"{','.join(hosts)} ({len(hosts) * cfg.ranks_per_host} ranks)")
