"""Typed results of ulfm operations: what every caller of layer 1 reads after a collective."""

from dataclasses import dataclass, field


class CollectiveTimeout(RuntimeError):
    """A ulfm operation did not complete within its timeout (a peer is alive but stalled).

    The operation is still in flight; the group stays unusable until the stalled peer is
    declared failed (the watchdog's job) or the process leaves.
    """


class BackendUnavailable(RuntimeError):
    """The compiled ulfm backend is missing or MPI fault tolerance is off; the message says how to fix it."""


@dataclass(frozen=True)
class FailureRecord:
    """What one operation observed about failures.

    failed_ranks: world ranks removed from the group by this operation's repair (data operations)
        or since the previous consensus (consensus).
    size, rank: the membership after the operation.
    epoch: the group epoch after the operation; bumped once per repair.
    repaired: this operation revoked and shrank the communicator.
    census: consensus only, the element-wise sum of every survivor's census.
    broken: a data operation of the torch data plane failed (`torch_plane.py`); the next
        consensus repairs the plane and names the dead.
    started_s, finished_s: when this rank's worker thread began and ended the operation (wall
        clock, time.time()'s); not part of what survivors compare.
    """

    failed_ranks: tuple[int, ...]
    size: int
    rank: int
    epoch: int
    repaired: bool
    census: tuple[int, ...] = ()
    broken: bool = False
    started_s: float = field(default=0.0, compare=False)
    finished_s: float = field(default=0.0, compare=False)

    @property
    def has_failure(self) -> bool:
        return self.repaired or self.broken or bool(self.failed_ranks)

    @classmethod
    def from_native(cls, native) -> "FailureRecord":
        return cls(
            failed_ranks=tuple(native.failed_ranks),
            size=native.size,
            rank=native.rank,
            epoch=native.epoch,
            repaired=native.repaired,
            census=tuple(native.census),
            started_s=native.started_s,
            finished_s=native.finished_s,
        )
