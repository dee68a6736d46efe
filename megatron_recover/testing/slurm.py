"""A Slurm cluster on one machine, over fake nodes (`nodes.FakeNodes`), for the Slurm tests.

The machine runs `munged` (a key generated for this cluster, its own socket) and `slurmctld` on
its address on the nodes' bridge; each fake node runs `slurmd -N NAME` inside its namespaces,
so a job's batch script, its `srun` steps and everything they start live on that node, as on a
cluster's compute node. Everything the cluster writes is in one state directory under /run
(visible on every node, as a cluster's shared file system is, where a node's /tmp is its own):
the generated `slurm.conf`, the munge key and socket, the controller's state, each node's spool
directory and log. No cgroups: `proctrack/linuxproc`, `task/none`. No accounting database: jobs'
completion records go to a text file (`jobcomp/filetxt`), which `sacct --completion` reads.

`down()` ends every job, stops the daemons by PID (the nodes' processes die with the nodes),
and removes the state directory: nothing it started is left. Needs root and Debian's
`slurmctld`, `slurmd`, `slurm-client` and `munge` (`scripts/install_slurm.sh`).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from megatron_recover.testing.nodes import FakeNodes, unavailable_reason as nodes_unavailable

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scontrol",
         "scancel", "sacct")
STATE_ROOT = Path("/run")  # shared with the nodes: only their /tmp and /dev/shm are their own


def unavailable_reason() -> str | None:
    """Why the cluster cannot be made here (None: it can)."""
    reason = nodes_unavailable()
    if reason:
        return reason
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"a Slurm cluster needs {', '.join(missing)}: scripts/install_slurm.sh installs "
                "Debian's slurmctld, slurmd, slurm-client and munge")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class SlurmCluster:
    """Slurm over `nodes` (already up); a context manager: up, then down. `cpus` per node."""

    def __init__(self, nodes: FakeNodes, cpus: int = 4, slurmd_timeout_s: int = 10):
        self.nodes = nodes
        self.cpus = cpus
        self.slurmd_timeout_s = slurmd_timeout_s
        self.state = Path(tempfile.mkdtemp(prefix="megatron-recover-slurm-", dir=STATE_ROOT))
        self.conf = self.state / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}  # "munged", "slurmctld", "slurmd NAME"

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm command needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def __enter__(self) -> "SlurmCluster":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    # Start-up.
    def up(self, timeout_s: float = 60.0) -> None:
        self._start_munge()
        self._write_conf()
        self._name_nodes()
        (self.state / "ctld").mkdir()
        self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for name in self.nodes.names:
            (self.state / name).mkdir()
            holder = self.nodes.holders[name].pid
            self._start(f"slurmd {name}", ["nsenter", "-t", str(holder), "-u", "-n", "-m", "--",
                                           "slurmd", "-D", "-N", name, "-f", str(self.conf)])
        self.wait_idle(self.nodes.names, timeout_s)

    def _start_munge(self) -> None:
        munge = self.state / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._start("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.socket}", f"--pid-file={munge}/munged.pid",
                               f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed"])
        deadline = time.monotonic() + 10.0
        while not self.socket.exists():
            if time.monotonic() > deadline or self.daemons["munged"].poll() is not None:
                raise RuntimeError(f"munged did not start: {self._log(munge / 'munged.log')}")
            time.sleep(0.05)

    @property
    def socket(self) -> Path:
        return self.state / "munge" / "munge.socket"

    def _write_conf(self) -> None:
        s = self.state
        lines = [
            "ClusterName=recover",
            f"SlurmctldHost={socket.gethostname()}({self.nodes.machine_address})",
            f"SlurmctldPort={_free_port()}",
            "SlurmdPort=6818",  # each node has its own network namespace
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={s}/ctld", f"SlurmdSpoolDir={s}/%n",
            f"SlurmctldPidFile={s}/slurmctld.pid", f"SlurmdPidFile={s}/%n/slurmd.pid",
            f"SlurmctldLogFile={s}/slurmctld.log", f"SlurmdLogFile={s}/%n/slurmd.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={s}/jobcomp.txt",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "MpiDefault=none", "SwitchType=switch/none",
            "ReturnToService=2", f"SlurmdTimeout={self.slurmd_timeout_s}",
            "InactiveLimit=0", "KillWait=5", "MinJobAge=600", "MessageTimeout=10",
            "SlurmdParameters=config_overrides",
        ]
        for name in self.nodes.names:
            lines.append(f"NodeName={name} NodeHostname={name} "
                         f"NodeAddr={self.nodes.address(name)} CPUs={self.cpus} State=UNKNOWN")
        lines.append("PartitionName=recover Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _name_nodes(self) -> None:
        """Every node resolves every node's name, as a cluster's DNS lets it (jobs connect to
        the host names Slurm and MPI give them): an /etc/hosts of the cluster, bound over the
        node's own in its mount namespace only; this machine's stays as it was."""
        hosts = self.state / "hosts"
        hosts.write_text("127.0.0.1 localhost\n"
                         f"{self.nodes.machine_address} {socket.gethostname()}\n"
                         + "".join(f"{self.nodes.address(n)} {n}\n" for n in self.nodes.names))
        for name in self.nodes.names:
            subprocess.run(["nsenter", "-t", str(self.nodes.holders[name].pid), "-m", "--",
                            "mount", "--bind", str(hosts), "/etc/hosts"], check=True,
                           capture_output=True, timeout=30)

    def _start(self, name: str, cmd: list[str]) -> None:
        with (self.state / f"{name.replace(' ', '-')}.out").open("wb") as log:
            self.daemons[name] = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=dict(os.environ, **self.env))

    # Commands.
    def run(self, *cmd: str, timeout_s: float = 30.0, check: bool = True) -> str:
        """A Slurm command, run on this machine; its output."""
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=dict(os.environ, **self.env))
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: rc {done.returncode}: "
                               f"{done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, names, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.node_states()
            if all(states.get(n, "").rstrip("*") == "idle" for n in names):
                return
            dead = [n for n, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Slurm cluster did not come up in {timeout_s:.0f} s (nodes {states}; "
                    f"exited: {dead}): {self.logs()}")
            time.sleep(0.5)

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> int:
        """Submit from this machine (the job's environment: this one, plus `env`); the id."""
        out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                             timeout=30, cwd=cwd, env=dict(os.environ, **self.env, **(env or {})))
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)}: {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict ({} once the controller forgot it)."""
        out = self.run("scontrol", "--oneliner", "show", "job", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, timeout_s: float, poll=None) -> dict[str, str]:
        """Until the job ends (its last `scontrol` record); `poll(record)` on every look."""
        deadline = time.monotonic() + timeout_s
        while True:
            record = self.job(job_id)
            if poll is not None:
                poll(record)
            if record.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING",
                                              "COMPLETING"):
                return record
            if time.monotonic() > deadline:
                self.run("scancel", str(job_id), check=False)
                raise TimeoutError(f"job {job_id} still {record.get('JobState')} after "
                                   f"{timeout_s:.0f} s (cancelled)")
            time.sleep(0.5)

    def steps(self, job_id: int) -> list[str]:
        """The job's running steps: `squeue --steps` lines (step id, name, nodes)."""
        out = self.run("squeue", "--noheader", "--steps", f"--jobs={job_id}",
                       "--format=%i %j %N", check=False)
        return [line.strip() for line in out.splitlines() if line.strip()]

    def completion(self, job_id: int) -> str:
        """The job's completion record, through `sacct --completion`."""
        return self.run("sacct", "--completion", f"--jobs={job_id}", "--noheader",
                        "--parsable2", "--format=JobID,JobName,State,ExitCode,NodeList",
                        check=False).strip()

    # What is left.
    def job_processes(self) -> dict[str, list[int]]:
        """Per node, its processes other than its slurmd: what jobs run or left there."""
        daemons = {p.pid for p in self.daemons.values()}
        return {name: [pid for pid in self.nodes.pids(name) if pid not in daemons]
                for name in self.nodes.names}

    def wait_no_job_processes(self, timeout_s: float) -> float:
        """Seconds until no node runs a job's process (slurmstepd ends a job's processes and
        then itself); raises with what is left after `timeout_s`."""
        start = time.monotonic()
        while any((left := self.job_processes()).values()):
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"processes left on the nodes after {timeout_s:.0f} s: "
                                     f"{self._describe(left)}")
            time.sleep(0.2)
        return time.monotonic() - start

    @staticmethod
    def _describe(left: dict[str, list[int]]) -> dict[str, list[str]]:
        named = {}
        for node, pids in left.items():
            for pid in pids:
                try:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    comm = "(gone)"
                named.setdefault(node, []).append(f"{pid} {comm}")
        return named

    def logs(self) -> str:
        parts = []
        for path in sorted(self.state.glob("*.log")) + sorted(self.state.glob("*/slurmd.log")):
            parts.append(f"--- {path.name} ({path.parent.name})\n{self._log(path)}")
        for path in sorted(self.state.glob("*.out")):
            parts.append(f"--- {path.name}\n{self._log(path)}")
        return "\n".join(parts)

    @staticmethod
    def _log(path: Path, lines: int = 15) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(none)"

    def down(self) -> None:
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--quiet", f"--user={os.geteuid()}", check=False,
                     timeout_s=10)
        for daemon in self.daemons.values():  # slurmd: by PID here; the nodes' down, too
            _kill(daemon.pid)
        for daemon in self.daemons.values():
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.state, ignore_errors=True)
