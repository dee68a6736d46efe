"""Process life cycle of a ULFM run: MPI start, torch.distributed rendezvous, and how a rank leaves.

Two ways a rank's exit hangs every survivor were measured (docs/ulfm-behaviour.md, "How a rank
may leave"): exiting with a non-zero status (never reported as a failure) and calling
MPI_Finalize after a failure. So a rank of ours leaves only by `os._exit(0)` or by SIGKILL to
itself, and never calls MPI_Finalize: whether any rank of the job saw a failure is not something
a rank can know without asking the dead, and under `--with-ft ulfm` an exit without Finalize is
an ordinary departure. Failure status goes to the rank's status file and log, never to the exit
code.

Nothing here runs on import; `init_distributed()` installs the exit discipline.
"""

import datetime
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from megatron_recover.mpi import failed_ranks, mpi

_state = {"status_path": None, "groups": [], "installed": False, "rank": "?",
          "torch_world_comm": None, "address": "127.0.0.1"}
FINAL_CONSENSUS_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DistributedContext:
    """What `init_distributed` set up for this rank."""

    rank: int
    world_size: int
    status_path: Path | None


def write_status(state: str, **fields) -> None:
    """Record this rank's state for the launcher to judge: `running`, `completed`, `left` (its
    replica lost a peer, so it left with it) or `error`."""
    path = _state["status_path"]
    if path is None:
        return
    record = {"state": state, "time": time.time(), **fields}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)


def write_progress(iteration: int) -> None:
    """Record the newest committed iteration (the lowest live rank calls it after each one), for
    the launcher's stall watchdog: `progress.json` beside the status files."""
    path = _state["status_path"]
    if path is None:
        return
    progress = path.with_name("progress.json")
    tmp = progress.with_name(f"progress.{os.getpid()}.tmp")  # a writer that moved may overlap
    tmp.write_text(json.dumps({"iteration": iteration, "time": time.time()}) + "\n")
    os.replace(tmp, progress)


# How long an error that names no cause waits for MPI's failure detector to report a failed
# replica peer before it counts as a program error: the detector reports a SIGKILLed peer within
# 10-50 ms (docs/ulfm-behaviour.md), gloo's own error follows it within 17-37 ms.
PEER_CONFIRM_S = 5.0


def set_program_errors(policy: str) -> None:
    """--recover-program-errors: what a program error (errors.PROGRAM) does on this rank from
    now on: `abort` ends the job, `survive` leaves as a failed rank. Unset (stock runs, start-up):
    every error takes the rank down as it always did."""
    _state["program_errors"] = policy


def set_replica_peers(replica_ranks: list[int]) -> None:
    """The MPI ranks of this rank's replica: a failure MPI reports among them explains an error
    of an intra-replica collective (the exit hook asks)."""
    me = mpi().COMM_WORLD.Get_rank()
    _state["replica_peers"] = {r for r in replica_ranks if r != me}


def _replica_peer_failed(wait_s: float) -> bool:
    """Whether MPI reports a peer of this rank's replica failed, polling up to `wait_s`."""
    peers = _state.get("replica_peers") or set()
    if not peers:
        return False
    MPI = mpi()
    world = MPI.COMM_WORLD
    deadline = time.monotonic() + wait_s
    while True:
        try:
            # Get_failed reports only what MPI has learnt, and it learns only while it progresses:
            # without this probe a killed peer stayed unknown for 20 s and more (with it, 50 ms:
            # docs/failures.md).
            world.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        except MPI.Exception:
            pass  # the probe itself may report the failure; Get_failed names it
        if failed_ranks(world) & peers:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)



def leave(reason: str) -> None:
    """Leave the run as a failed rank does (SIGKILL, status `left` with `reason`): for a rank
    whose replica is gone, so that the survivors handle it as any other failure. Never
    returns."""
    write_status("left", error=reason)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def start_replica_gate(replica_ranks: list[int], period_s: float) -> threading.Thread:
    """Leave (SIGKILL, status `left`) once MPI knows any other rank of this replica failed.

    The failure detector's verdicts reach every process, so this thread notices a peer that
    crashed or froze even while the main thread is blocked in an intra-replica collective with
    it (a frozen peer never closes its sockets, so gloo alone would wait for its timeout).
    """
    world = mpi().COMM_WORLD
    me = world.Get_rank()
    peers = [r for r in replica_ranks if r != me]

    def watch():
        while True:
            time.sleep(period_s)
            lost = sorted(failed_ranks(world) & set(peers))
            if lost:
                leave(f"replica gate: replica peer(s) {lost} failed")

    thread = threading.Thread(target=watch, name="replica-gate", daemon=True)
    thread.start()
    return thread


HEARTBEATS_PER_TIMEOUT = 4  # Open MPI: the detector's timeout must exceed 3 periods


def configure_hang_detection(timeout_s: float) -> None:
    """Turn frozen processes into failures within `timeout_s` (call before MPI starts).

    Open MPI's failure detector, with its own heartbeat thread so that a rank computing for
    longer than the timeout without MPI calls keeps answering, declares a peer that stopped
    answering failed; the runtime then kills it and ULFM reports it like a crash. (Without the
    thread a long compute is a false positive; with it MPI_Finalize can hang, which a ULFM run of
    ours never calls: docs/ulfm-behaviour.md, "Frozen ranks and Open MPI's failure detector".)
    Works across hosts: the heartbeats are MPI messages.
    Settings given explicitly to mpirun (--mca) win over these. The detector thread's start-up
    race in Open MPI is defused by `init_mpi` (see `_ignore_early_heartbeats`).

    The heartbeat period is a quarter of the timeout: Open MPI requires the timeout to exceed
    3 periods, because an observer suspects its peer after one timeout without a heartbeat and
    a heartbeat the BTL cannot take at once is dropped, not retried. At half the timeout (as
    before) two lost or late heartbeats made a live rank "reported dead by someone else", and
    Open MPI aborted it (a failure-free 6-rank CI run, rank 0, at the 60 s default).
    """
    settings = {"mpi_ft_detector": "true", "mpi_ft_detector_thread": "true",
                "mpi_ft_detector_timeout": f"{timeout_s:g}",
                "mpi_ft_detector_period": f"{timeout_s / HEARTBEATS_PER_TIMEOUT:g}"}
    for name, value in settings.items():
        os.environ.setdefault(f"OMPI_MCA_{name}", value)


def _end_children() -> None:
    """Stop the helper processes libraries started (megatron-core's checkpoint writer keeps a
    multiprocessing manager). `os._exit` skips the exit handlers that would stop them, and an
    orphan holding this rank's stdout keeps mpirun waiting for it forever."""
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=5.0)


def write_to_terminal(text: str) -> None:
    """Write `text` to file descriptor 2 now, in full, bypassing `sys.stderr`.

    For a rank about to kill itself: under plain `mpirun`, a traceback written through
    `sys.stderr` (and flushed) right before the SIGKILL was measured never to reach the
    terminal, while the same bytes written to the descriptor did.
    """
    data = text.encode(errors="replace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:  # the terminal is gone (mpirun ended): the status file still has it
        pass


def _die_on_uncaught(exc_type, exc, tb) -> None:
    """The exit hook: classify the error (`failures`), then leave as a failed rank (SIGKILL: the
    survivors absorb it) or, for a program error under --recover, end the whole job."""
    from megatron_recover import errors  # torch is loaded by now; not before MPI starts

    text = "".join(traceback.format_exception(exc_type, exc, tb))
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    try:
        # Only a --recover run in training acts on the kind; a stock run stops on any failure
        # and must not wait for MPI first (its peers then see this rank die promptly).
        recovering = _state.get("program_errors") is not None
        kind = errors.classify(exc, lambda: recovering and _replica_peer_failed(PEER_CONFIRM_S))
        place = errors.where()
    except BaseException as error:  # noqa: BLE001 - whatever happens, the rank must go
        kind, place = errors.PEER_LOST, {"iteration": None, "microbatch_id": None}
        text += f"\n(classifying it failed too: {error!r})"
    ends_job = kind == errors.PROGRAM and _state.get("program_errors") == errors.ABORT
    daemon = _open_mpi_daemon() if ends_job else None
    if daemon is not None:  # none: mpirun is gone, the job is being torn down
        write_to_terminal(
            f"megatron-recover: rank {_state['rank']} ends the job: a program error "
            f"{errors.describe(place)}. It would recur on every replica that runs this "
            "microbatch, so no survivor runs it again (--recover-program-errors survive treats "
            f"it as a failure of this rank):\n{text}")
        sys.stdout.flush()
        write_status("error", error=text[-4000:], kind=kind, ended_job=True, **place)
        _end_children()
        _end_job(daemon)
    write_to_terminal(f"megatron-recover: rank {_state['rank']} stops on an error: {kind}\n"
                      f"{text}")
    sys.stdout.flush()
    # A lost peer is the replica gate at work and a device fault a failure of this rank: the
    # survivors absorb both, as they absorb a program error with --recover-program-errors
    # survive. Without --recover (a stock run stops on any failure) it stays an error.
    absorbed = kind != errors.PROGRAM or _state.get("program_errors") == errors.SURVIVE
    write_status("left" if absorbed else "error", error=text[-4000:], kind=kind, **place)
    _end_children()
    # A signal death is what ULFM detects; a non-zero exit would leave the peers waiting.
    os.kill(os.getpid(), signal.SIGKILL)


# After SIGTERM to this rank's Open MPI daemon, how long before SIGKILL to it, then to the rank.
END_JOB_WAIT_S = 10.0


def _open_mpi_daemon() -> int | None:
    """The nearest ancestor that is Open MPI's daemon on this node (prted, or prterun/mpirun on
    mpirun's node): ranks may be started through a wrapper script."""
    pid = os.getppid()
    for _ in range(8):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        if name in ("prted", "prterun", "mpirun", "mpiexec", "orted"):
            return pid
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: ppid
        if pid <= 1:
            return None
    return None


def _end_job(daemon: int) -> None:
    """End the whole job while this rank stays alive (so no survivor takes over its
    microbatches): SIGTERM, then SIGKILL, to `daemon`, this node's Open MPI daemon (mpirun
    itself on mpirun's node). Open MPI 5 ends the whole job when it loses a daemon
    (docs/node-loss.md). Not MPI_Abort: under ULFM it kills the caller alone, and the
    survivors absorb that as a failure (docs/failures.md). Never returns."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(daemon, sig)
        except ProcessLookupError:
            break
        time.sleep(END_JOB_WAIT_S)
    os.kill(os.getpid(), signal.SIGKILL)


def install_exit_discipline(status_path: Path | None) -> None:
    """Uncaught exceptions (any thread) kill the rank by SIGKILL after logging them."""
    _state["status_path"] = status_path
    if _state["installed"]:
        return
    sys.excepthook = _die_on_uncaught
    threading.excepthook = lambda args: _die_on_uncaught(args.exc_type, args.exc_value,
                                                         args.exc_traceback)
    _state["installed"] = True


def track_group(group) -> None:
    """ulfm groups on which `finish()` holds a last consensus before the rank leaves."""
    _state["groups"].append(group)


# Open MPI's BTL active-message tag of ULFM's reliable broadcast (MCA_BTL_TAG_FT_RBCAST in
# opal/mca/btl/btl.h, 5.0.x), which carries the failure detector's heartbeats.
_FT_RBCAST_TAG = 0x30
_early_heartbeats = {"callback": None, "dropped": 0}


def _detector_thread_requested() -> bool:
    """Whether Open MPI will run its failure detector in a thread (set by
    `configure_hang_detection`; mpirun's --mca settings reach the ranks as these variables too)."""
    def on(name):
        return os.environ.get(f"OMPI_MCA_{name}", "").strip().lower() in ("1", "true", "yes",
                                                                             "t", "y", "enabled")
    return on("mpi_ft_detector") and on("mpi_ft_detector_thread")


def _ignore_early_heartbeats() -> bool:
    """Make a failure-detector heartbeat that arrives during MPI_Init harmless (call before it).

    Open MPI 5.0.x bug: with mpi_ft_detector_thread, each rank's detector thread starts inside
    MPI_Init right after the modex fence and at once sends its first heartbeat (BTL tag 0x30) to
    the next rank, before the second start-up fence. A peer still in its modex wait (its PMIx
    thread has not yet seen the fence release: common when ranks oversubscribe the cores) polls
    the shared-memory BTL, finds that fragment and calls the tag's callback, which ULFM registers
    only later in the same MPI_Init (ompi_comm_rbcast_init): a call through NULL, SIGSEGV in
    opal_progress > mca_btl_sm_poll_handle_frag. Its peers then crash in ompi_comm_revoke_local,
    handling that failure inside their own MPI_Init.

    The guard puts a no-op callback in the tag's slot of libopen-pal's (statically zeroed)
    `mca_btl_base_active_message_trigger` table before MPI_Init; ompi_comm_rbcast_init replaces
    it with the real one. A heartbeat dropped that early is one the receiving detector would
    ignore anyway: it is not watching yet, and starts with slack. Returns whether the guard is in
    place; it is skipped, leaving MPI_Init as it was, when the library is not Open MPI or the slot
    is already taken.
    """
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            pal = next((line.split()[-1] for line in maps
                        if "/libopen-pal.so" in line.split()[-1]), None)
        if pal is None:
            return False
        # {cbfunc, cbdata} per tag
        table = (ctypes.c_void_p * (2 * _FT_RBCAST_TAG + 2)).in_dll(
            ctypes.CDLL(pal), "mca_btl_base_active_message_trigger")
    except (OSError, ValueError):
        return False
    if table[2 * _FT_RBCAST_TAG] is not None:
        return False

    def drop(btl, descriptor):
        _early_heartbeats["dropped"] += 1

    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(drop)
    _early_heartbeats["callback"] = callback  # the table may point at it for the process's life
    table[2 * _FT_RBCAST_TAG] = ctypes.cast(callback, ctypes.c_void_p).value
    return True


def _startmpi():
    """mpi4py's MPI module with MPI initialized at MPI_THREAD_MULTIPLE (what mpi4py's own start
    does); with the detector thread on, MPI_Init runs behind `_ignore_early_heartbeats`."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules and _detector_thread_requested():
        mpi4py.rc.initialize = False
    MPI = mpi()
    if not MPI.Is_initialized():
        _ignore_early_heartbeats()
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


def init_mpi(status_dir: Path | None = None) -> DistributedContext:
    """Start MPI for this rank of an `mpirun --with-ft ulfm` job; install the exit discipline."""
    MPI = _startmpi()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    status_path = None
    if status_dir is not None:
        status_dir = Path(status_dir)
        status_dir.mkdir(parents=True, exist_ok=True)
        status_path = status_dir / f"rank-{rank}.json"
    _state["rank"] = rank
    install_exit_discipline(status_path)
    write_status("running", pid=os.getpid(), host=socket.gethostname())
    return DistributedContext(rank=rank, world_size=size, status_path=status_path)


def torch_world_comm():
    """The MPI communicator over this rank's torch.distributed world (`init_torch_distributed`),
    as it was made at start-up."""
    return _state["torch_world_comm"]


def init_torch_distributed(ctx: DistributedContext, backend: str = "gloo",
                           timeout_s: float = 1800.0, world_id: int = 0,
                           network: str | None = None) -> None:
    """torch.distributed over the MPI ranks that pass the same `world_id`, and the `ulfm`
    backend registered. Collective over the whole MPI world.

    Every rank passes 0 except standby replicas (--recover-standby-replicas), each of which
    gets a torch world of its own ranks (megatron's parallel state then lays out one replica);
    the training ranks must come first in MPI rank order, so that their torch ranks are their
    MPI ranks. The TCP store lives in the world's lowest rank only for start-up: it is created
    without waiting for workers, its port travels over MPI, and after `init_process_group`
    nothing reads it again (ulfm groups are built from MPI communicators), so that rank may die
    later like any other.
    """
    import torch
    import torch.distributed as dist

    world = _state["torch_world_comm"] = mpi().COMM_WORLD.Split(world_id, ctx.rank)
    rank, size = world.Get_rank(), world.Get_size()
    offset = ctx.rank - rank  # the world's ranks are consecutive MPI ranks (the caller's order)
    host = _rendezvous_host(world, network)
    store = None
    port = 0
    if rank == 0:
        store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False)
        port = store.port
    port = world.bcast(port, root=0)
    if rank != 0:
        store = dist.TCPStore(host, port, size, is_master=False)
    torch.set_num_threads(1)
    if backend == "nccl":
        # An NCCL collective that errs or outlives its group's timeout (megatron's groups: a
        # multiple of --recover-hang-timeout) aborts this process, a signal death that ULFM
        # reports like any other; the replica gate usually takes the rank down sooner.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    # The timeout bounds every gloo collective: a rank stuck in one leaves (exit hook) instead of
    # waiting forever for a peer that hangs.
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))

    from megatron_recover import collective

    collective.register()
    collective.set_world_rank_offset(offset)


def ipv4_addresses() -> dict[str, str]:
    """This host's network interfaces and their (first) IPv4 addresses."""
    import fcntl
    import struct

    addresses = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address
                continue
            addresses[name] = socket.inet_ntoa(packed[20:24])
    return addresses


def _rendezvous_host(world, network: str | None) -> str:
    """The address of the world's rank 0 for torch.distributed's store, and gloo's interface.

    One host: loopback. Several, with `network` (a CIDR: the launcher's --if-include, which Open
    MPI uses too): gloo uses this host's interface in it (GLOO_SOCKET_IFNAME, unless given) and
    rank 0's address there is the store's. Several without it: rank 0's hostname, which every
    host must resolve (gloo resolves its own likewise).
    """
    import ipaddress

    hostname = socket.gethostname()
    mine = None
    if network:
        addresses = ipaddress.ip_network(network)
        mine = next(((name, address) for name, address in ipv4_addresses().items()
                     if ipaddress.ip_address(address) in addresses), None)
        if mine is None:
            raise RuntimeError(f"--if-include {network}: host {hostname} has no interface in it")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", mine[0])
    hosts = world.allgather((hostname, mine[1] if mine else None))
    if all(h == hosts[0][0] for h, _ in hosts):
        return "127.0.0.1"
    _state["address"] = mine[1] if mine else hostname
    return hosts[0][1] or hosts[0][0]


def own_address() -> str:
    """Where the other ranks reach a store this rank hosts: loopback when the job is on one
    host, else this host's address in --if-include's network, or its hostname
    (`init_torch_distributed` decides)."""
    return _state["address"]


def init_distributed(status_dir: Path | None = None, backend: str = "gloo") -> DistributedContext:
    """`init_mpi` then `init_torch_distributed`."""
    ctx = init_mpi(status_dir)
    init_torch_distributed(ctx, backend)
    return ctx


def finish(finalize: bool = False, **fields) -> None:
    """Leave the run: a last consensus on every tracked group, record `completed`, `os._exit(0)`.

    Never returns. The consensus keeps a fast rank from leaving while its peers still need it in
    a collective; a peer that is gone by then is simply reported and ignored. `finalize` (runs
    without fault tolerance only, where no rank can have failed) calls MPI_Finalize first, as a
    plain MPI job must.
    """
    epochs = {}
    for group in _state["groups"]:
        try:
            record = group.consensus().wait(FINAL_CONSENSUS_TIMEOUT_S)
            epochs[len(epochs)] = record.epoch
        except Exception as error:  # leaving anyway: the status file says what went wrong
            epochs[len(epochs)] = repr(error)
    write_status("completed", group_epochs=epochs, **fields)
    sys.stdout.flush()
    sys.stderr.flush()
    _end_children()
    if finalize:
        mpi().Finalize()
    os._exit(0)


def stop_at_startup(message: str | None, finalize: bool = False) -> None:
    """A user mistake found before training: say what to change, record it, leave. Never returns.

    Every rank finds the same mistake, so only rank 0 prints. `message` None: argparse already
    printed its own. `finalize`: MPI runs without fault tolerance, where a rank leaving without
    MPI_Finalize makes mpirun kill the others, perhaps before rank 0's message is out.
    """
    if message is not None and mpi().COMM_WORLD.Get_rank() == 0:
        sys.stderr.write(f"megatron-recover: error: {message}\n")
    write_status("error", error=message or "invalid arguments")
    sys.stdout.flush()
    sys.stderr.flush()
    if finalize:
        mpi().Finalize()
    os._exit(0)
