"""In-memory snapshots: a node loss costs at most --recover-snapshot-interval iterations.

Open MPI's runtime ends the whole job when a node (its daemon) is lost, and nothing can be saved
at that point (ranks on the mpirun node get no signal, the others are killed 0.2-0.3 s after a
SIGTERM: docs/node-loss.md, "What the surviving ranks receive"). So every
--recover-snapshot-interval iterations a rank copies its complete training state at the
iteration boundary and a helper thread writes the copy into node-local shared memory
(--recover-snapshot-dir, /dev/shm by default):

  DIR/iter_NNNNNNN/mp_rank_TT_PPP[_shard_SS]-replica_RRRR.pt

one file per position and node, written by the lowest live replica with a rank there (replicas
hold the same bytes): the position's model, optimizer (with the distributed optimizer's main
parameters and Adam moments), loss scaler, scheduler, RNG states and the protocol state
(`ProtocolState.state_dict()` under `protocol`, as checkpoints and joins carry it: the policy
layout, the straggler history, the committed reserve ids, ...). A file is written under a
temporary name and renamed when complete: the rename is its completion marker, so a snapshot
torn by the failure is never read. Each writer keeps its newest complete snapshot until the next
one is complete (two buffers): its files of older iterations are deleted only then.

Replicas hold identical states, so every surviving replica holds a full copy of the model state,
and with distributed-optimizer instances every instance holds every shard index. A relaunch
(`restore`) therefore needs no other copy while one full replica survives: it resumes from the
newest iteration whose files, over the surviving nodes, cover every position of the new job,
the same iteration on every rank; a rank whose node has no file of its position (a spare host)
receives it from one that has. When no iteration is covered (no replica survived whole), the run
falls back to the newest on-disk checkpoint (--load), or starts from scratch without one.
"""

import io
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_recover.megatron.adapters import groups
from megatron_recover.megatron.persistence import loading
from megatron_recover.megatron.persistence import training_state
from megatron_recover.recovery.membership import transfer
from megatron_recover.recovery.protocol_state import ProtocolState


def position_name(position: tuple[int, ...]) -> str:
    """A snapshot file's position: (tensor rank, pipeline rank) or, with distributed-optimizer
    shards, (tensor rank, pipeline rank, shard)."""
    name = f"mp_rank_{position[0]:02d}_{position[1]:03d}"
    if len(position) == 3:
        name += f"_shard_{position[2]:02d}"
    return name


_FILE = re.compile(r"^(mp_rank_\d+_\d+(?:_shard_\d+)?)-replica_\d+\.pt$")


class HostMirror:
    """Host copies of a state's tensors, kept from one snapshot to the next.

    `copy(state)` returns `state` with every tensor replaced by its host copy (containers as
    `transfer.split_tensors` rebuilds them): a buffer allocated at the first snapshot (page-locked
    where CUDA is present) and overwritten at each later one, so a snapshot takes no device
    memory and, after the first, no allocation.
    Device tensors are copied asynchronously on the current stream; `ready()` waits for those
    copies, and the writer thread calls it before it reads the copies. On the CPU the copies are
    plain host-to-host copies and `ready()` has nothing to wait for. The caller lets the
    previous snapshot's write finish before the next `copy` (the buffers are reused).
    """

    def __init__(self):
        self._buffers: dict[int, torch.Tensor] = {}  # by the tensor's place in the state
        self._event = None

    def copy(self, state):
        tensors: list[torch.Tensor] = []
        skeleton = transfer.split_tensors(state, tensors)
        for index, source in enumerate(tensors):
            buffer = self._buffers.get(index)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = self._buffers[index] = torch.empty(
                    source.shape, dtype=source.dtype, device="cpu",
                    pin_memory=torch.cuda.is_available())
            buffer.copy_(source.detach(), non_blocking=True)
        if torch.cuda.is_available():
            self._event = torch.cuda.Event()
            self._event.record()
        return transfer.fill_tensors(skeleton, self._buffers)

    def ready(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


def _iteration_of(path: Path) -> int | None:
    name = path.name
    return int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None


def inventory(directory: Path) -> dict[int, set[str]]:
    """The complete snapshot files on this node: iteration -> position names."""
    found = {}
    if not directory.is_dir():
        return found
    for path in directory.iterdir():
        iteration = _iteration_of(path)
        if iteration is None:
            continue
        names = {m.group(1) for m in map(_FILE.match, (p.name for p in path.iterdir())) if m}
        if names:
            found[iteration] = names
    return found


class Snapshots:
    """This rank's snapshot writer: `take` at the iteration boundary, `finish` at the end.

    `take` copies the state into host memory on the calling thread (`HostMirror`: reused
    buffers, asynchronous from a device) and returns; the helper thread writes it. A `take`
    while the previous write still runs waits for it first (a rank has at most one write in
    flight, so the files of its previous snapshot are always complete, and the host buffers are
    free to reuse).
    """

    def __init__(self, directory: Path, interval: int, position: tuple[int, ...], replica: int,
                 replicas_here: list[int] | None = None,
                 slow_writes: dict[int, float] | None = None, on_pause=None):
        """`replicas_here`: the replicas with a rank at this position on this node (default:
        this one); the lowest live one writes the node's copy. `slow_writes` (failure
        schedules): iteration -> seconds its write pauses halfway, after `on_pause(iteration)`."""
        self.directory = Path(directory)
        self.interval = interval
        self.replica = replica
        self.replicas_here = replicas_here or [replica]
        self.name = f"{position_name(position)}-replica_{replica:04d}.pt"
        self._slow_writes = slow_writes or {}
        self._on_pause = on_pause
        self._mirror = HostMirror()
        self._writer: threading.Thread | None = None
        self._previous: int | None = None  # the newest snapshot this rank completed
        self.copy_s: list[float] = []  # time on the training thread, per snapshot
        self.write_s: list[float] = []  # time of the helper thread's write, per snapshot
        self.error: BaseException | None = None

    def due(self, iteration: int, live_replicas) -> bool:
        """Whether this rank snapshots after `iteration`: one of the interval's, and this rank
        the lowest live replica of its position on its node (the others' copies are the same
        bytes; a replica lost in-step hands the node's copy to the next)."""
        here = [r for r in self.replicas_here if r in live_replicas]
        return (self.interval > 0 and iteration % self.interval == 0
                and bool(here) and min(here) == self.replica)

    def take(self, iteration: int, state: dict) -> None:
        """Snapshot `state` (what `state.capture` returns plus the protocol state's
        `state_dict()` under `protocol`)
        as of the end of `iteration`; blocks only for the copy (and a write still running)."""
        start = time.perf_counter()
        self.wait()
        copy = {**self._mirror.copy(state), "iteration": iteration}
        self.copy_s.append(time.perf_counter() - start)
        self._writer = threading.Thread(target=self._write, args=(iteration, copy),
                                        name="snapshot-writer", daemon=True)
        self._writer.start()

    def _write(self, iteration: int, copy: dict) -> None:
        start = time.perf_counter()
        try:
            self._mirror.ready()
            path = loading.iteration_dir(self.directory, iteration) / self.name
            tmp = path.with_suffix(".tmp")
            buffer = io.BytesIO()
            torch.save(copy, buffer)
            data = buffer.getbuffer()
            with _create(tmp) as f:
                if iteration in self._slow_writes:
                    half = len(data) // 2
                    f.write(data[:half])
                    f.flush()
                    self._on_pause(iteration)
                    time.sleep(self._slow_writes[iteration])
                    data = data[half:]
                f.write(data)
            tmp.rename(path)  # the completion marker
            previous, self._previous = self._previous, iteration
            if previous is not None:
                self._remove_own(lambda t: t < previous)
        except BaseException as error:  # reported by wait(), on the training thread
            self.error = error
        self.write_s.append(time.perf_counter() - start)

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self.error is not None:
            raise RuntimeError(f"snapshot write to {self.directory} failed: {self.error!r}")

    def _remove_own(self, drop) -> None:
        """Remove this rank's files of the iterations `drop(iteration)` selects, and their
        directories once empty. Only its own: a writer of another position on this node may
        lag a snapshot behind, and its newest complete file must stay."""
        for path in self.directory.glob(f"iter_*/{self.name}"):
            iteration = _iteration_of(path.parent)
            if iteration is not None and drop(iteration):
                path.unlink(missing_ok=True)
                try:
                    path.parent.rmdir()
                except OSError:  # other files are still there
                    pass

    def finish(self) -> None:
        """Training ended here: wait for the last write. The files stay: a rank that ends
        training may still be in a job that then loses a node before every rank completed, and
        the relaunch needs them (the launcher frees its default directory once the job
        completed)."""
        self.wait()


def _create(path: Path):
    """`path` opened for writing, its directory made first; a rank of this node that finished
    the run may remove the (empty) directory meanwhile (`finish`), so this tries again."""
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return open(path, "wb")
        except (FileNotFoundError, FileExistsError):  # removed between the two steps
            continue


def prune(directory: Path, drop) -> None:
    """Remove the iteration directories `drop(iteration)` selects."""
    for path in list(directory.glob("iter_*")):
        iteration = _iteration_of(path)
        if iteration is not None and drop(iteration):
            shutil.rmtree(path, ignore_errors=True)


def choose(inventories: list[tuple[str, str, dict[int, set[str]]]]) -> int | None:
    """The newest iteration at which, for every position, some rank of that position has its
    file on its node; `inventories` holds (hostname, position name, node inventory) of every
    rank. None: no iteration is covered."""
    needed = {name for _, name, _ in inventories}
    iterations = set().union(*(found for _, _, found in inventories))
    covered = [t for t in iterations
               if all(any(other == name and name in found.get(t, ())
                          for _, other, found in inventories) for name in needed)]
    return max(covered) if covered else None


def restore(directory: Path, group, position: tuple[int, ...], chunks, optimizer,
            scheduler, after: int = 0) -> ProtocolState | None:
    """Resume from the newest snapshot the surviving nodes hold in full (see the module
    docstring), if it is newer than iteration `after` (an on-disk checkpoint's); None when
    there is none. Every rank of the (torch) world calls it at start-up.

    `group` is this position's cross-replica group: a rank without a local file of its position
    receives its state, tensor by tensor, from the lowest rank that has one. Contract: no rank
    fails during the restore (the job ends and the launcher relaunches it again).
    """
    name = position_name(position)
    mine = inventory(directory)
    hostname = socket.gethostname()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (hostname, name, mine), group=groups.world_control())
    iteration = choose(everyone)
    if iteration is None or iteration <= after:
        return None
    members = [rank for rank, (_, other, _) in enumerate(everyone) if other == name]
    holders = [rank for rank in members if name in everyone[rank][2].get(iteration, ())]
    local = loading.iteration_dir(directory, iteration)
    if all(rank in holders for rank in members):
        path = next(local.glob(f"{name}-replica_*.pt"))
        saved = torch.load(path, map_location="cpu", weights_only=False)  # our own files
    else:
        assert sorted(group.members) == members, (group.members, members)
        donor = min(holders)
        saved = None
        if dist.get_rank() == donor:  # mapped, not read: it goes out tensor by tensor
            saved = torch.load(next(local.glob(f"{name}-replica_*.pt")), map_location="cpu",
                               mmap=True, weights_only=False)
        saved, ok = transfer.broadcast_state(group, donor, saved)
        if not ok:
            raise RuntimeError("a rank failed while restoring a snapshot")
    if saved["iteration"] != iteration:
        raise RuntimeError(f"snapshot {local} holds iteration {saved['iteration']}")
    training_state.restore(saved, chunks, optimizer, scheduler)
    # Every rank has its state: the lowest rank of each node removes the other iterations there
    # (later ones belong to the run that ended and are written again; older ones are not needed).
    dist.barrier(group=groups.world_control())
    if dist.get_rank() == min(r for r, (h, _, _) in enumerate(everyone) if h == hostname):
        prune(directory, lambda t: t != iteration)
    dist.barrier(group=groups.world_control())
    return ProtocolState.from_state_dict(saved["protocol"])
