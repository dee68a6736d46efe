"""The torch data plane of a cross-replica group (`--recover-data-plane torch`).

A cross-replica group has two planes. The control plane is the ulfm group: consensus, census,
epochs and joins, where MPI's fault tolerance (agreement, revoke, shrink) is what is needed. The
data plane carries the bytes: the gradient buckets, the commit lane, the state of a join. Here it
is a torch process group created with `enable_reconfigure` (gloo for CPU tensors; NCCL's
`ProcessGroupNCCL2` for CUDA tensors), whose membership follows the survivors.

`TorchPlaneGroup` has `ULFMGroup`'s interface, so the round core does not know which plane it
drives. What differs, and why it is safe:

- A data operation that fails (the torch collective raises, or a member of the group is known
  dead while it waits) returns a record with `broken` set and leaves the plane broken: later
  operations return failed at once, posting nothing. gloo cannot abort a collective in flight
  (torch 2.14.1: `abort()` and `shutdown()` leave it waiting until its timeout), so a wait gives
  up as soon as MPI knows a member failed (`Comm.Get_failed`, within 0.1-0.2 s of a kill), and
  the abandoned operation ends on its own.
- The repair happens at the next `consensus`: its census carries each member's broken flag; when
  the agreement found a failure or a member is broken, every survivor rebuilds the data plane
  (the reconfigure handles exchanged over the control plane, a rendezvous store on the lowest
  survivor, `reconfigure` over the agreed members in rank order) and the data epoch advances, so
  every bucket reduced before it is stale and rewound, as after a ulfm repair. The consensus is
  then run again; it returns only when no member died and none is broken, so a failure during
  the rebuild is survived the same way.
- A standby joins through the control plane's `adopt`; the grown group rebuilds the data plane
  with the joiner's handle, and the data epoch becomes one past the largest member's.

No store outlives its rebuild's need: the rendezvous store is created by the lowest survivor for
each rebuild and its address travels over MPI, so no rank holds a store the others depend on.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import struct
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

try:  # torch 2.14: reconfigurable process groups
    from torch._C._distributed_c10d import ReconfigureOptions
except ImportError:
    ReconfigureOptions = None

from megatron_recover.collective.backend import ULFMGroup
from megatron_recover.collective.records import CollectiveTimeout, FailureRecord

# How often a wait checks whether MPI knows a member failed. A kill reaches MPI's view in
# 0.1-0.2 s (docs/data-planes.md); a 20 ms poll adds little to that.
POLL_S = 0.02
# The points this plane offers to the failure simulator: its data operations (the ulfm group's
# names) and `reconfigure` (a rebuild, after the handles are exchanged); the control plane's
# own points (consensus, shrink, adopt, barrier) stay native.
DATA_POINTS = ("reduce", "broadcast", "allgather", "reconfigure")
_HANDLE_BYTES = 256
_ADDRESS_BYTES = 256
_HEADER = struct.Struct("<qqqq")  # data epoch, store port, handle length, address length


def reconfigure_supported() -> bool:
    """Whether this torch has the reconfigurable process groups the plane needs."""
    return ReconfigureOptions is not None and hasattr(dist.ProcessGroupGloo,
                                                        "get_reconfigure_handle")


class _RelayStore(dist.Store):
    """The store a process group is built with, relaying to the rendezvous store of the current
    rebuild: a group's store is fixed at its creation, the host of the rendezvous is not."""

    def __init__(self):
        super().__init__()
        self.inner = None

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        return self.inner.check(keys)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()


@dataclass(frozen=True)
class PlaneOptions:
    """How one rank builds its data plane."""

    device: str  # "cpu" (gloo) or "cuda" (NCCL, the current device)
    address: str  # where peers reach this rank's rendezvous store when it hosts one
    stable_rank: int  # the MPI world rank: names this rank in every handle
    stable_size: int  # the MPI world size
    timeout_s: float  # a wait on a live but stalled peer: CollectiveTimeout after it
    reconfigure_timeout_s: float  # one rebuild's rendezvous and connections


class TorchPlaneWork:
    """A data operation in flight. `wait()` returns its FailureRecord; `broken` when it failed."""

    def __init__(self, plane: "TorchPlaneGroup", work=None, finish=None, control=None):
        self._plane = plane
        self._work = work
        self._finish = finish  # run after success (an all-gather's copy out)
        self._control = control  # a control-plane work instead (a CPU tensor under NCCL)
        self._posted_s = time.time()

    def wait(self, timeout_s: float | None = None) -> FailureRecord:
        plane = self._plane
        if self._control is not None:
            return plane._from_control(self._control.wait(timeout_s))
        if self._work is None:  # not posted: the plane was already broken
            return plane._record(broken=True)
        # Polled, not a completion callback: a Python callback makes the backend's worker
        # thread take the GIL at each completion, while backward holds it (with one, 1.10x
        # stock's iteration time at bench_overhead's compute size; polled, 1.03x). The poll
        # starts at 0.2 ms and doubles to 2 ms: a coarser one adds its period to each wait.
        limit = plane.options.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        delay, checked = 0.0002, time.monotonic()
        while not self._work.is_completed():
            time.sleep(delay)
            delay = min(2 * delay, 0.002)
            if time.monotonic() - checked >= POLL_S:
                checked = time.monotonic()
                if plane._member_failed():
                    plane._abandon()
                    return plane._record(broken=True, started_s=self._posted_s)
                if checked > deadline:
                    raise CollectiveTimeout(f"torch data plane: an operation did not complete "
                                            f"within {limit:g} s")
        try:
            self._work.wait()
        except RuntimeError:  # gloo's and NCCL's errors (DistBackendError is one)
            plane._broken = True
            return plane._record(broken=True, started_s=self._posted_s)
        if self._finish is not None:
            self._finish()
        return plane._record(started_s=self._posted_s)

    def is_completed(self) -> bool:
        if self._control is not None:
            return self._control.is_completed()
        return self._work is None or self._work.is_completed()


class TorchPlaneGroup:
    """A cross-replica group whose data operations run on a reconfigurable torch process group
    and whose control operations run on `control` (see the module docstring). Every member calls
    the same operations in the same order, as on `ULFMGroup`."""

    def __init__(self, control: ULFMGroup, options: PlaneOptions):
        self.control = control
        self.options = options
        # The rebuild's exchange is judged the same on every survivor (one agreement per control
        # data operation); the control plane carries no bulk data, so this costs nothing.
        control.set_agree_each_op(True)
        self._pg = None
        self._stuck = False  # the current group has an abandoned operation in flight
        self._broken = True  # no data group yet: the first consensus builds it
        self._abandoned = []  # groups with abandoned operations: kept until those end
        self._store = None  # this rebuild's rendezvous store (kept until the next one)
        self._data_epoch = -1  # the first build makes it 0: it counts repairs, as a ulfm epoch
        self._data_members: list[int] = []
        self._arms: list[dict] = []
        self._hits: dict[str, int] = {}
        self._repair([])

    # -- membership, as ULFMGroup ---------------------------------------------------------

    @property
    def process_group(self):
        """The control plane's torch group (megatron's data-parallel group object)."""
        return self.control.process_group

    @property
    def epoch(self) -> int:
        """The data epoch: 0 after the first build, advanced once per rebuild after it (a
        repair, as a ulfm group's epoch counts them), equal on all survivors after a
        consensus."""
        return self._data_epoch

    @property
    def size(self) -> int:
        return self.control.size

    @property
    def rank(self) -> int:
        return self.control.rank

    @property
    def members(self) -> list[int]:
        return self.control.members

    @property
    def backend(self) -> str:
        """The data plane's torch backend: "gloo" or "nccl"."""
        return "nccl" if self.options.device == "cuda" else "gloo"

    # -- data operations ----------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor) -> TorchPlaneWork:
        """In-place SUM over the live members. On failure the tensor's contents are not to be
        trusted."""
        if not self._on_plane(tensor):
            return TorchPlaneWork(self, control=self.control.allreduce(tensor))
        return self._post("reduce", lambda pg: pg.allreduce([tensor]))

    def broadcast(self, tensor: torch.Tensor, src_world_rank: int) -> TorchPlaneWork:
        if not self._on_plane(tensor):
            return TorchPlaneWork(self, control=self.control.broadcast(tensor, src_world_rank))
        options = dist.BroadcastOptions()
        options.rootRank = self._data_members.index(src_world_rank)
        return self._post("broadcast", lambda pg: pg.broadcast([tensor], options))

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor) -> TorchPlaneWork:
        """Gather `tensor` from every live member into `output` (size x numel elements)."""
        if not self._on_plane(tensor):
            return TorchPlaneWork(self, control=self.control.allgather(output, tensor))
        rows = list(output.view(len(self._data_members), -1).unbind(0))
        received = [torch.empty_like(tensor) for _ in rows]

        def copy_out():
            for row, piece in zip(rows, received):
                row.copy_(piece.reshape(-1))

        return self._post("allgather", lambda pg: pg.allgather([received], [tensor]), copy_out)

    # -- control operations ---------------------------------------------------------------

    def barrier(self):
        return self.control.barrier()

    def consensus(self, census: list[int] | tuple[int, ...] = ()) -> "_Done":
        """Fault-aware barrier: every survivor gets the same record (`ULFMGroup.consensus`),
        and the data plane rebuilt over them when a member died or a member's data plane broke
        since the last one."""
        return _Done(self._repair(list(census)))

    def adopt(self, grown) -> "_Done":
        """Grow back (`ULFMGroup.adopt`), then rebuild the data plane over the grown group with
        the joiners' handles. The record's census is [1] when it took."""
        record = self.control.adopt(grown).wait()
        failed = record.failed_ranks
        if record.census and record.census[0] == 1:
            self._broken = True
            failed += self._repair([]).failed_ranks  # a member lost during the rebuild
        return _Done(FailureRecord(failed_ranks=failed, size=self.size, rank=self.rank,
                                   epoch=self.epoch, repaired=record.repaired or bool(failed),
                                   census=record.census))

    def set_agree_each_op(self, on: bool) -> None:
        """The data plane's verdicts are made uniform by the next consensus; the control
        plane's operations always agree (see __init__)."""

    def set_max_chunk_bytes(self, nbytes: int) -> None:
        self.control.set_max_chunk_bytes(nbytes)

    def set_stage_host(self, on: bool) -> None:
        self.control.set_stage_host(on)

    def set_direct_device(self, on: bool) -> None:
        raise ValueError("--recover-cuda-aware-mpi is for the mpi data plane: the torch plane "
                         "moves CUDA tensors with NCCL already")

    def staging_stats(self) -> dict[str, int]:
        return self.control.staging_stats()

    # -- the failure simulator's points ---------------------------------------------------

    def arm_fault(self, point: str, occurrence: int, action: str, delay_s: float,
                  marker_path: str, marker_fields: dict | None = None) -> None:
        """As `ULFMGroup.arm_fault`; the data points fire in this plane: a kill or stop at
        `reduce`, `broadcast` or `allgather` after the operation is posted, at `reconfigure`
        inside a rebuild (every member holds the others' handles, none has connected)."""
        if point not in DATA_POINTS:
            if point.endswith("-chunk"):
                raise ValueError(f"fault point {point}: the torch data plane moves a transfer "
                                 "in one operation, not in chunks")
            self.control.arm_fault(point, occurrence, action, delay_s, marker_path,
                                   marker_fields)
            return
        if action not in ("kill", "stop", "delay"):
            raise ValueError(f"unknown fault action '{action}'")
        self._arms.append({"point": point, "occurrence": occurrence, "action": action,
                           "delay_s": delay_s, "marker_path": marker_path,
                           "fields": dict(marker_fields or {})})

    def set_fault_phase(self, phase: str) -> None:
        _phase["now"] = phase
        self.control.set_fault_phase(phase)

    def fault_hits(self, point: str) -> int:
        if point in DATA_POINTS:
            return self._hits.get(point, 0)
        return self.control.fault_hits(point)

    # -- internals ------------------------------------------------------------------------

    def _on_plane(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.options.device

    def _post(self, point: str, start, finish=None) -> TorchPlaneWork:
        due = self._reached(point)
        if self._broken:
            return TorchPlaneWork(self)
        work = TorchPlaneWork(self, start(self._pg), finish)
        self._fire(due)  # inside the operation: posted, then die
        return work

    def _reached(self, point: str) -> list[dict]:
        """Count a hit of `point`; sleep for its due delays; return its due kills and stops."""
        count = self._hits[point] = self._hits.get(point, 0) + 1
        due = [arm for arm in self._arms if arm["point"] == point and arm["occurrence"] == count]
        for arm in due:
            if arm["action"] == "delay":
                time.sleep(arm["delay_s"])
        return [arm for arm in due if arm["action"] != "delay"]

    def _fire(self, due: list[dict]) -> None:
        for arm in due:
            time.sleep(arm["delay_s"])
            _die_with_marker(arm, self.options.stable_rank)

    def _record(self, broken: bool = False, started_s: float | None = None) -> FailureRecord:
        """A data operation's record; `started_s`: when it was posted (the wait's return is
        its `finished_s`, within the wait's poll of its completion)."""
        now = time.time()
        return FailureRecord(failed_ranks=(), size=self.size, rank=self.rank,
                             epoch=self._data_epoch, repaired=False, broken=broken,
                             started_s=now if started_s is None else started_s, finished_s=now)

    def _from_control(self, record: FailureRecord) -> FailureRecord:
        """A control-plane data operation's record, in the data epoch (its repair shows in the
        next consensus, which rebuilds the data plane)."""
        if record.has_failure:
            self._broken = True
        return FailureRecord(failed_ranks=record.failed_ranks, size=record.size,
                             rank=record.rank, epoch=self._data_epoch,
                             repaired=record.repaired, broken=record.has_failure,
                             started_s=record.started_s, finished_s=record.finished_s)

    def _member_failed(self) -> bool:
        """Whether MPI knows a member of the data group failed (a local query, no message)."""
        return bool(_known_failed() & set(self._data_members))

    def _abandon(self) -> None:
        """Give up on the operation in flight: the group is replaced at the rebuild."""
        self._broken = True
        self._stuck = True

    def _repair(self, census: list[int]) -> FailureRecord:
        """Consensus until no member died and none is broken, rebuilding between."""
        failed: list[int] = []
        while True:
            record = self.control.consensus([*census, int(self._broken)]).wait()
            failed += record.failed_ranks
            if not record.failed_ranks and record.census[-1] == 0:
                break
            self._rebuild()
        return FailureRecord(failed_ranks=tuple(failed), size=record.size, rank=record.rank,
                             epoch=self._data_epoch, repaired=record.repaired or bool(failed),
                             census=record.census[:-1], started_s=record.started_s,
                             finished_s=record.finished_s)

    def _rebuild(self) -> None:
        """Reconfigure the data group over the control plane's members (every survivor calls
        it after the same consensus). Leaves `_broken` set when it did not complete here."""
        self._broken = True
        if self._pg is None or self._stuck:
            if self._pg is not None:
                self._abandoned.append(self._pg)
            self._pg = self._new_process_group()
            self._stuck = False
        host = self.control.rank == 0
        store, port = None, 0
        if host:
            store = dist.TCPStore(self.options.address, 0, self.size, is_master=True,
                                  wait_for_workers=False, timeout=self._reconfigure_timeout)
            port = store.port
        rows = self._exchange(port)
        if rows is None:
            return
        self._data_epoch = max(row[0] for row in rows) + 1
        self._fire(self._reached("reconfigure"))
        members = self.control.members
        try:
            if not host:
                store = dist.TCPStore(rows[0][3], rows[0][1], self.size, is_master=False,
                                      timeout=self._reconfigure_timeout)
            self._pg_store.inner = store
            self._store = store
            options = ReconfigureOptions()
            options.uuid = self._data_epoch + 1  # fresh per rebuild, positive
            options.handles = [row[2] for row in rows]
            options.timeout = self._reconfigure_timeout
        except RuntimeError:
            return
        if not self._run_reconfigure(options, members):
            return
        self._data_members = members
        self._broken = False

    def _run_reconfigure(self, options, members: list[int]) -> bool:
        """`reconfigure` on a helper thread, given up on when a member is known dead (it would
        otherwise wait for that member's keys until its timeout)."""
        outcome = {}

        def run():
            try:
                self._pg.reconfigure(options).wait()
                outcome["ok"] = True
            except RuntimeError as error:
                outcome["error"] = error

        thread = threading.Thread(target=run, name="data-plane-reconfigure", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(POLL_S)
            if thread.is_alive() and _known_failed() & set(members):
                self._stuck = True
                return False
        return outcome.get("ok", False)

    def _exchange(self, port: int) -> list[tuple[int, int, str, str]] | None:
        """Every member's (data epoch, store port, reconfigure handle, address), in control
        rank order, over the control plane; None when a member died during it."""
        handle = self._pg.get_reconfigure_handle().encode()
        address = self.options.address.encode()
        if len(handle) > _HANDLE_BYTES or len(address) > _ADDRESS_BYTES:
            raise ValueError(f"reconfigure handle {handle!r} or address {address!r} too long")
        row = bytearray(_HEADER.size + _HANDLE_BYTES + _ADDRESS_BYTES)
        _HEADER.pack_into(row, 0, self._data_epoch, port, len(handle), len(address))
        row[_HEADER.size:_HEADER.size + len(handle)] = handle
        offset = _HEADER.size + _HANDLE_BYTES
        row[offset:offset + len(address)] = address
        mine = torch.frombuffer(row, dtype=torch.uint8).clone()
        out = torch.zeros(self.size * mine.numel(), dtype=torch.uint8)
        if self.control.allgather(out, mine).wait().has_failure:
            return None
        rows = []
        for chunk in out.view(self.size, -1):
            data = bytes(chunk.tolist())
            epoch, port_, n_handle, n_address = _HEADER.unpack_from(data, 0)
            rows.append((epoch, port_, data[_HEADER.size:_HEADER.size + n_handle].decode(),
                         data[offset:offset + n_address].decode()))
        return rows

    @property
    def _reconfigure_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.options.reconfigure_timeout_s)

    def _new_process_group(self):
        store = _RelayStore()
        # The collective's own timeout is a backstop past the wait's (`TorchPlaneWork.wait`).
        timeout = datetime.timedelta(seconds=2 * self.options.timeout_s)
        rank, size = self.options.stable_rank, self.options.stable_size
        if self.options.device == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options.enable_reconfigure = True
            options._timeout = timeout
            pg = torch._C._distributed_c10d.ProcessGroupNCCL2(store, rank, size, options)
            pg.bound_device_id = torch.device("cuda", torch.cuda.current_device())
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout, enable_reconfigure=True)
        self._pg_store = store
        return pg


@dataclass
class _Done:
    """A control operation the plane already completed (consensus, adopt): its record."""

    record: FailureRecord

    def wait(self, timeout_s: float | None = None) -> FailureRecord:
        return self.record

    def is_completed(self) -> bool:
        return True


def _known_failed() -> set[int]:
    """The MPI world ranks this process knows failed. The progress call lets a notice that
    arrived while this thread waited outside MPI be seen without the detector thread."""
    from mpi4py import MPI

    MPI.COMM_SELF.Iprobe()
    failed = MPI.COMM_WORLD.Get_failed()
    try:
        if failed.Get_size() == 0:
            return set()
        return set(MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())),
                                             MPI.COMM_WORLD.Get_group()))
    finally:
        failed.Free()


_phase = {"now": ""}


def _die_with_marker(arm: dict, world_rank: int) -> None:
    """Leave the marker the ulfm backend's points leave, then die (or freeze: "stop")."""
    line = {"point": arm["point"], "rank": world_rank, "time": time.time(),
            "phase": _phase["now"], **arm["fields"]}
    fd = os.open(arm["marker_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.kill(os.getpid(), signal.SIGSTOP if arm["action"] == "stop" else signal.SIGKILL)
