"""Python side of the `ulfm` torch.distributed backend (layer 1).

`register()` makes "ulfm" a torch.distributed backend name; `new_group(ranks)` creates a group on
it and returns a `ULFMGroup`, the handle the recovery layer uses. Collectives go through the
handle (`allreduce`, `broadcast`, `allgather`, `barrier`, `consensus`), each returning a Work whose
`wait()` yields a `FailureRecord`. Plain `torch.distributed` calls on `group.process_group` (a stock
Megatron job over ulfm) fail stop instead: the group is repaired, then `wait()` raises
`DistBackendError` naming the dead ranks, as a gloo group would raise.
"""

import datetime
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_recover.collective.records import (
    BackendUnavailable,
    CollectiveTimeout,
    FailureRecord,
)

BACKEND_NAME = "ulfm"
DEFAULT_TIMEOUT_S = 600.0

_native = None
_backends = {}  # group name -> native ProcessGroupULFM, filled by the creator below
# torch.distributed rank + this offset = MPI world rank. 0 unless torch.distributed spans only
# part of the MPI world (a standby replica's own world: `set_world_rank_offset`).
_world_rank_offset = 0


def native_module():
    """The compiled extension; raises BackendUnavailable with the fix when it is missing."""
    global _native
    if _native is None:
        try:
            from megatron_recover.collective import _ulfm_backend
        except ImportError as error:
            raise BackendUnavailable(
                "the ulfm backend is not built; run `make build` in the megatron-recover checkout"
            ) from error
        _native = _ulfm_backend
    return _native


def require_fault_tolerance() -> None:
    """Raise BackendUnavailable, saying how to relaunch, unless MPI runs with ULFM on."""
    if not native_module().fault_tolerance_enabled():
        raise BackendUnavailable(
            "MPI fault tolerance is off: relaunch with `mpirun --with-ft ulfm ...` "
            "(or `megatron-recover launch`), with an Open MPI 5 that has ULFM"
        )


def set_world_rank_offset(offset: int) -> None:
    """torch.distributed's rank r is MPI world rank `offset` + r (call before creating groups)."""
    global _world_rank_offset
    _world_rank_offset = offset


def world_ranks(ranks: list[int]) -> list[int]:
    """The MPI world ranks of torch.distributed ranks `ranks` (`set_world_rank_offset`)."""
    return [_world_rank_offset + r for r in ranks]


def _create_backend(dist_opts, backend_options):
    native = native_module()
    require_fault_tolerance()
    ranks = list(dist_opts.global_ranks_in_group) or list(range(dist_opts.group_size))
    ranks = world_ranks(ranks)
    timeout_s = dist_opts.timeout.total_seconds()
    if _split_parent is not None:
        backend = native.ProcessGroupULFM(ranks, dist_opts.group_id, timeout_s,
                                          parent=_split_parent)
    elif _duplicate is not None:
        backend = native.ProcessGroupULFM(ranks, dist_opts.group_id, timeout_s,
                                          duplicate=_duplicate)
    else:
        backend = native.ProcessGroupULFM(ranks, dist_opts.group_id, timeout_s)
    _backends[dist_opts.group_id] = backend
    return backend


def register() -> None:
    """Register "ulfm" with torch.distributed (idempotent)."""
    native_module()
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
        )


@dataclass
class ULFMWork:
    """An operation in flight. `wait()` returns its FailureRecord (has_failure False on success)."""

    native: object
    timeout_s: float | None = None

    def wait(self, timeout_s: float | None = None) -> FailureRecord:
        limit = timeout_s if timeout_s is not None else self.timeout_s
        try:
            if limit is None:
                self.native.wait()
            else:
                self.native.wait(datetime.timedelta(seconds=limit))
        except dist.DistBackendError as error:
            if "did not complete within" in str(error):
                raise CollectiveTimeout(str(error)) from error
            raise
        return FailureRecord.from_native(self.native.record())

    def is_completed(self) -> bool:
        return self.native.is_completed()


class ULFMGroup:
    """A fault-tolerant group over a fixed set of world ranks.

    Every member must call the same operations in the same order. Operations are asynchronous:
    they return a ULFMWork at once and run on the group's worker thread.
    """

    def __init__(self, process_group, native):
        self.process_group = process_group
        self._native = native

    @property
    def epoch(self) -> int:
        """Bumped once per repair; equal on all survivors after a consensus."""
        return self._native.epoch()

    @property
    def size(self) -> int:
        """Live members (the torch group's own size stays the size at creation)."""
        return self._native.current_size()

    @property
    def rank(self) -> int:
        return self._native.current_rank()

    @property
    def members(self) -> list[int]:
        """World ranks of the live members, in rank order."""
        return list(self._native.members())

    def set_agree_each_op(self, on: bool) -> None:
        """Make each data operation's failure verdict uniform (one agreement per call)."""
        self._native.set_agree_each_op(on)

    def set_max_chunk_bytes(self, nbytes: int) -> None:
        """The most bytes one MPI call of a broadcast or all-gather moves (default 1 GiB); larger
        transfers run in chunks of this size, any total size. Set it on every member alike."""
        self._native.set_max_chunk_bytes(int(nbytes))

    def set_stage_host(self, on: bool) -> None:
        """Stage CPU tensors through the group's host buffers, as CUDA tensors always are (the
        copy in, MPI on the buffer, the copy back only on success): the staged path runs on
        machines without a GPU. Tests use it; it costs two copies per operation."""
        self._native.set_stage_host(bool(on))

    def set_direct_device(self, on: bool) -> None:
        """Hand CUDA tensors' device memory to MPI instead of staging them through pinned host
        buffers (16-bit sums are staged all the same: MPI runs their sum on the host). Raises
        ValueError unless the MPI is CUDA-aware (`mpi_cuda_aware()`)."""
        self._native.set_direct_device(bool(on))

    def staging_stats(self) -> dict[str, int]:
        """The host buffer pool's counters: buffers allocated, acquisitions served by an idle
        buffer (reused), buffers idle now and their bytes."""
        return dict(self._native.staging_stats())

    def allreduce(self, tensor: torch.Tensor) -> ULFMWork:
        """In-place SUM. On failure the tensor's contents are not to be trusted."""
        return ULFMWork(self._native.allreduce_sum(tensor))

    def broadcast(self, tensor: torch.Tensor, src_world_rank: int) -> ULFMWork:
        return ULFMWork(self._native.broadcast_from(tensor, src_world_rank))

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor) -> ULFMWork:
        """Gather `tensor` from every live member into `output` (size x numel elements)."""
        return ULFMWork(self._native.allgather_into(output, tensor))

    def barrier(self) -> ULFMWork:
        return ULFMWork(self._native.barrier_ft())

    def consensus(self, census: list[int] | tuple[int, ...] = ()) -> ULFMWork:
        """Fault-aware barrier: every survivor gets the same record.

        The record lists the world ranks lost since the previous consensus, the agreed epoch and
        the element-wise sum of the survivors' census vectors (all must pass the same length).
        """
        return ULFMWork(self._native.consensus([int(c) for c in census]))

    def adopt(self, grown) -> ULFMWork:
        """Grow back: make `grown` (an mpi4py communicator over the live members and the
        joiners) this group's communicator. Collective over `grown`; a joiner calls it on the
        one-member group it waited in. `wait()`'s record has census [1] when it took, on every
        live member alike (epoch: one past the largest member's), [0] when it did not (`grown`
        revoked, the group as before). The caller keeps `grown` referenced: the group uses it.
        """
        from mpi4py import MPI

        return ULFMWork(self._native.adopt(MPI._handleof(grown)))

    def arm_fault(self, point: str, occurrence: int, action: str, delay_s: float,
                  marker_path: str, marker_fields: dict | None = None) -> None:
        """Test hook; see megatron_recover.faults. `marker_fields` join the victim's marker."""
        extra = json.dumps(marker_fields or {})[1:-1]
        self._native.arm_fault(point, occurrence, action, delay_s, marker_path, extra)

    def set_fault_phase(self, phase: str) -> None:
        """Test hook: what this process's main thread is doing now (process-wide, not per
        group); a victim that dies on a worker thread writes it into its marker as "phase"."""
        native_module().set_fault_phase(phase)

    def fault_hits(self, point: str) -> int:
        """How many times this rank reached fault point `point` (arm relative to it)."""
        return self._native.fault_hits(point)


_split_parent = None  # the native group new groups split from (`new_group`'s `parent`)
_duplicate = None  # the MPI_Comm handle new groups duplicate (`new_group`'s `duplicate`)


def new_group(ranks: list[int], timeout_s: float = DEFAULT_TIMEOUT_S,
              parent: "ULFMGroup | None" = None, duplicate=None) -> ULFMGroup | None:
    """Create a ulfm group over `ranks` (world ranks); None on ranks outside it.

    Like torch.distributed.new_group, every rank calls it for every group, in the same order;
    the MPI communicator is built by the members only. With `parent`, it is split from the
    parent's communicator instead: after a failure the world's holds a dead rank, over which
    no communicator can be created. Then every live member of `parent` calls at once, each for
    its own group (disjoint ones), the parent idle and repaired (a consensus on it). With
    `duplicate`, an mpi4py communicator whose members are exactly `ranks`, it is that
    communicator's duplicate, made by all of them.
    """
    global _split_parent, _duplicate
    register()
    _split_parent = None if parent is None else parent._native
    if duplicate is not None:
        from mpi4py import MPI

        _duplicate = MPI._handleof(duplicate)
    try:
        return _new_group(ranks, timeout_s)
    finally:
        _split_parent = _duplicate = None


def _new_group(ranks: list[int], timeout_s: float) -> ULFMGroup | None:
    pg = dist.new_group(
        ranks=sorted(ranks), backend=BACKEND_NAME,
        timeout=datetime.timedelta(seconds=timeout_s), use_local_synchronization=True,
    )
    if pg is None or pg is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    return ULFMGroup(pg, _backends[pg.group_name])
