"""Several nodes on one machine, for the node-loss tests and benchmark (needs root).

A fake node is a holder process in its own hostname, network and mount namespaces, with private
tmpfs mounts on /tmp and /dev/shm (Open MPI's session directory, our snapshots; this checkout and
its Python environment stay visible there, as on a shared file system) and a veth link to a
bridge in the machine's namespace. The bridge takes 10.77.X.1/24, node k 10.77.X.(k+1), for an
X no address of this machine uses: those addresses exist only inside what the harness made.
The bridge's MAC address is set, not left to Linux: an unset bridge takes the lowest MAC of its
ports and changes it when that port goes, so the loss of one node would move the machine's MAC
under the others, whose ARP entries then point nowhere (connections to the machine seen to hang
68 s or time out, a relaunch's daemon to fail to report back), which a cluster's head node never
does.
The machine itself is the first host (it runs mpirun and the first ranks, as a job's first node
does). mpirun reaches the other nodes through `fake_ssh.sh`, an ssh stand-in that enters a node's
namespaces (`--prtemca plm_ssh_agent`).

What a node loss is made of, each by PID:
  kill_node    every process of the node and its holder: the host is gone, unreachable after.
  kill_daemon  only the node's PRRTE daemons: its ranks are orphaned, the host stays reachable.
  silence      its link down, then its processes: it vanished without closing a connection,
               and the ssh stand-in blocks as a real client would.

`down()` (also on leaving the `with`) kills every process living in a node's network namespace,
the holders and the stand-ins still running, and deletes the links and the bridge: the machine
is left as it was. Nothing is killed that the harness did not start.
"""

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AGENT = Path(__file__).with_name("fake_ssh.sh")
# What every node runs, as a cluster's shared file system holds it: this package's checkout and
# the Python environment (a clone under /tmp would otherwise vanish behind a node's own /tmp).
SHARED = (Path(__file__).resolve().parents[2], Path(sys.prefix).resolve())
PRIVATE = (Path("/tmp"), Path("/dev/shm"))
TOOLS = ("unshare", "nsenter", "ip")
STATE_ENV = "MEGATRON_RECOVER_FAKE_NODES"


def unavailable_reason() -> str | None:
    """Why fake nodes cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "fake nodes need root (network and mount namespaces, a bridge)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"fake nodes need {', '.join(missing)} (util-linux, iproute2)"
    return None


def _ip(*args: str, netns_of: int | None = None, check: bool = True) -> str:
    cmd = ["ip", *args]
    if netns_of is not None:
        cmd = ["nsenter", "-t", str(netns_of), "-n", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.stdout


def _free_subnet() -> int:
    used = _ip("-4", "-o", "addr")
    for x in range(77, 250):
        if f" 10.77.{x}." not in used and f" 10.{x}." not in used:
            return x
    raise RuntimeError("no free 10.77.X.0/24 subnet for fake nodes")


def _net_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _node_mounts() -> str:
    """Shell commands that give a new node's mount namespace its private /tmp and /dev/shm
    while the SHARED paths under them stay visible: each is opened first (fds 3, 4, ...) and
    bound back from its descriptor after the tmpfs hides it (a bind from another namespace's
    view, /proc/PID/root, is refused)."""
    kept = [p for p in SHARED if any(p.is_relative_to(private) for private in PRIVATE)]
    opened = "".join(f"exec {3 + i}<{shlex.quote(str(p))}; " for i, p in enumerate(kept))
    bound = "".join(f"mkdir -p {shlex.quote(str(p))} && mount --no-canonicalize --bind "
                    f"/proc/self/fd/{3 + i} {shlex.quote(str(p))}; exec {3 + i}<&-; "
                    for i, p in enumerate(kept))
    return (opened + " ".join(f"mount -t tmpfs tmpfs {p};" for p in PRIVATE) + " " + bound)


class FakeNodes:
    """`names` fake nodes beside this machine; use as a context manager (up, then down)."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.subnet = _free_subnet()
        self.bridge = f"mrbr{self.subnet}"
        self.state = Path(tempfile.mkdtemp(prefix="megatron-recover-nodes-"))
        self.holders: dict[str, subprocess.Popen] = {}
        self.namespaces: dict[str, str] = {}  # net namespace of each node (outlives its holder)

    # What a launch needs.
    @property
    def hosts(self) -> list[str]:
        """This machine first, then the fake nodes."""
        return [socket.gethostname(), *self.names]

    @property
    def cidr(self) -> str:
        return f"10.77.{self.subnet}.0/24"

    @property
    def env(self) -> dict[str, str]:
        return {STATE_ENV: str(self.state)}

    @property
    def machine_address(self) -> str:
        """This machine's address on the nodes' network (the bridge's)."""
        return f"10.77.{self.subnet}.1"

    @property
    def bridge_mac(self) -> str:
        """Locally administered, unicast, from the bridge's address 10.77.X.1."""
        return f"02:00:0a:4d:{self.subnet:02x}:01"

    def address(self, name: str) -> str:
        return f"10.77.{self.subnet}.{self.names.index(name) + 2}"

    def _veth(self, name: str) -> str:
        return f"mrv{self.subnet}n{self.names.index(name)}"

    def __enter__(self) -> "FakeNodes":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "address", self.bridge_mac)
        _ip("addr", "add", f"{self.machine_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name in self.names:
            holder = subprocess.Popen(
                ["unshare", "--uts", "--net", "--mount", "--propagation", "private", "sh", "-c",
                 f"hostname {name}; {_node_mounts()}exec sleep 1000000"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
            self.holders[name] = holder
            (self.state / f"{name}.pid").write_text(f"{holder.pid}\n")
            self._wait_for_hostname(name, holder.pid)
            self.namespaces[name] = _net_namespace(holder.pid)
            veth = self._veth(name)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns",
                str(holder.pid))
            _ip("link", "set", veth, "master", self.bridge, "up")
            for args in (("link", "set", "lo", "up"),
                         ("addr", "add", f"{self.address(name)}/24", "dev", "eth0"),
                         ("link", "set", "eth0", "up")):
                _ip(*args, netns_of=holder.pid)

    def _wait_for_hostname(self, name: str, pid: int) -> None:
        """Until the holder has set its hostname and mounts and sleeps (`exec sleep`)."""
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                sleeping = Path(f"/proc/{pid}/comm").read_text().strip() == "sleep"
            except OSError:
                break
            if sleeping:
                return
            time.sleep(0.05)
        raise RuntimeError(f"fake node {name} did not come up")

    # The processes of a node.
    def pids(self, name: str) -> list[int]:
        """Every process in node `name`'s network namespace, its holder excepted."""
        holder = self.holders[name].pid
        namespace = self.namespaces.get(name)
        if namespace is None:
            return []
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != holder
                and _net_namespace(int(p)) == namespace]

    def _commands(self, name: str) -> dict[int, str]:
        commands = {}
        for pid in self.pids(name):
            try:
                commands[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                pass
        return commands

    def _agents(self, host: str | None = None) -> list[int]:
        """PIDs of the ssh stand-ins still running (for `host`, or all)."""
        log = self.state / "agents.log"
        if not log.exists():
            return []
        pids = []
        for line in log.read_text().splitlines():
            fields = dict(item.split("=", 1) for item in line.split())
            pid = int(fields["pid"])
            if host is not None and fields["host"] != host:
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if AGENT.name.encode() in cmdline or b"sleep" in cmdline:  # ours, not a reused PID
                pids.append(pid)
        return pids

    # Node losses.
    def kill_node(self, name: str) -> list[int]:
        """The whole node: its processes, its holder (the host is gone), its stand-in."""
        killed = self.pids(name)
        for pid in killed:
            _kill(pid)
        _kill(self.holders[name].pid)
        self.holders[name].wait(timeout=10)
        for pid in self._agents(name):
            _kill(pid)
        return killed

    def kill_daemon(self, name: str) -> list[int]:
        """Only the node's PRRTE daemons (prted); its ranks and the host stay."""
        killed = [pid for pid, comm in self._commands(name).items() if comm == "prted"]
        for pid in killed:
            _kill(pid)
        return killed

    def silence(self, name: str) -> list[int]:
        """The node vanishes silently: link down first, then its processes die; no connection
        is ever closed and its ssh stand-in blocks."""
        (self.state / f"{name}.silent").touch()
        _ip("link", "set", self._veth(name), "down")
        killed = self.pids(name)
        for pid in killed:
            _kill(pid)
        return killed

    def leftovers(self) -> dict[str, list]:
        """What a run left on the nodes: processes in their namespaces, stand-ins still running."""
        return {"processes": [pid for name in self.holders for pid in self.pids(name)],
                "agents": self._agents()}

    def down(self) -> None:
        for name, holder in self.holders.items():
            for _ in range(20):  # a process may fork while the first sweep runs
                pids = self.pids(name)
                if not pids:
                    break
                for pid in pids:
                    _kill(pid)
                time.sleep(0.1)
            _kill(holder.pid)
            holder.wait(timeout=10)
        for pid in self._agents():
            _kill(pid)
        for name in self.holders:
            _ip("link", "del", self._veth(name), check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.state, ignore_errors=True)

    def links(self) -> list[str]:
        """The harness's network devices that still exist on this machine."""
        names = [self.bridge, *(self._veth(n) for n in self.names)]
        present = _ip("-o", "link", check=False)
        return [n for n in names if f" {n}:" in present or f" {n}@" in present]
