"""An in-process stand-in for one ulfm group, for the unit tier: the members are threads.

It follows the contract of `csrc/ulfm_backend/ulfm_backend.hpp` as `ULFMGroup` exposes it, not
the MPI underneath:

  * A data operation (`allreduce`) either completes over the current membership or returns a
    `FailureRecord` with `repaired` set. A repair removes the dead members, bumps the caller's
    epoch by exactly one and gives the caller a new communicator (a new *generation* here).
  * Outcomes may differ across survivors: a member that dies inside an all-reduce after its
    contribution went out (`kill(..., contributed=True, lucky=...)`) lets the `lucky` survivors
    complete with the full sum while the others repair. The lucky ones learn of it at their next
    operation: their communicator was revoked, so it fails and they repair then, one operation
    later than the others. Survivors may therefore post their following operations misaligned,
    as MPI would match them on the new communicator: matched operations of equal size sum
    whatever they hold (a garbage result the protocol may not trust), of unequal size fail.
  * `consensus(census)` is uniform: every survivor gets the same failed ranks since its previous
    consensus, the same size, the largest epoch any of them holds, and the element-wise sum of
    the census vectors. A member entering consensus fails the data operations others still
    wait for it in (they could never be matched), as a mismatched MPI call would.

Operations run when posted, on the calling thread (a rendezvous of the members); `Work.wait()`
returns the record. Two simplifications follow, and what they cannot show is left to the mpi
tier: no operation is ever in flight when a named point of the trainer fires (a kill at
`after-post` lands after the first reduction completed everywhere), and every consensus starts a
fresh matching order, where MPI would keep matching operations on the same communicator. A member is killed by raising `RankKilled` on its thread at the armed point:
the thread ends, as the process would. Every wait is bounded (`timeout_s`): a protocol bug that
would hang a job raises `FakeHang` instead.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from megatron_recover.collective import FailureRecord, TorchPlaneGroup


class RankKilled(BaseException):
    """Raised on a member's thread at its armed kill point: the member is dead from then on.

    A BaseException, so that no `except Exception` of the code under test survives it."""


class FakeHang(AssertionError):
    """A rendezvous waited longer than the world's bound: the protocol would hang a real job."""


@dataclass
class _Kill:
    ops: int  # die inside the member's ops-th data operation from the arming
    contributed: bool  # the member's contribution reached the others before it died
    lucky: frozenset[int]  # survivors whose operation completes (only with `contributed`)


@dataclass
class _Slot:
    """One data operation of one generation, matched by its position in each member's order."""

    key: tuple[int, int]  # (generation, position in each member's order)
    members: tuple[int, ...]
    arrived: dict[int, torch.Tensor] = field(default_factory=dict)
    victims: set[int] = field(default_factory=set)  # died in this op after contributing
    lucky: set[int] = field(default_factory=set)
    results: dict[int, FailureRecord | torch.Tensor] | None = None


@dataclass
class _View:
    """What one member's backend knows."""

    generation: int = 0
    seq: int = 0  # data operations posted in this generation
    epoch: int = 0
    members: tuple[int, ...] = ()
    at_consensus: tuple[int, ...] = ()
    data_ops: int = 0  # since the last arming
    kill: _Kill | None = None
    consensus_round: int = 0
    in_consensus: bool = False


class FakeWorld:
    """The shared state of one fake ulfm group over world ranks `ranks`."""

    def __init__(self, ranks, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.members = tuple(sorted(ranks))  # the live membership of the newest generation
        self.generation = 0
        self.dead: set[int] = set()
        self.views = {r: _View(members=self.members, at_consensus=self.members) for r in ranks}
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.rounds: dict[int, dict] = {}  # consensus round -> census by rank, result
        self.log: list[tuple] = []  # (event, rank, detail): what happened, for the tests
        self.nonfinite_sent: list[tuple] = []  # (rank, slot): a data operation's NaN/inf input

    def group(self, rank: int) -> "FakeGroup":
        return FakeGroup(self, rank)

    # -- membership ------------------------------------------------------------------------

    def kill(self, rank: int, where: str) -> None:
        """`rank` dies now, on its own thread: raises RankKilled there."""
        with self.cond:
            self._die(rank, where)

    def kill_quietly(self, rank: int) -> None:
        """`rank`'s thread ended by an error of its own: the others see it dead."""
        with self.cond:
            self._mark_dead(rank, "by its own error")

    def _die(self, rank: int, where: str) -> None:
        self._mark_dead(rank, where)
        raise RankKilled(f"rank {rank} killed {where}")

    def _mark_dead(self, rank: int, where: str) -> None:
        self.dead.add(rank)
        self.log.append(("killed", rank, where))
        self.cond.notify_all()

    def _repair(self, view: _View) -> tuple[int, ...]:
        """This member's communicator failed: it joins the newest generation, without the dead.
        Returns the ranks it lost."""
        if view.generation == self.generation:
            # The first member to repair this generation makes the new communicator.
            self.generation += 1
            self.members = tuple(r for r in self.members if r not in self.dead)
        before = view.members
        view.generation = self.generation
        view.seq = 0
        view.epoch += 1
        view.members = self.members
        return tuple(r for r in before if r not in view.members)

    def _record(self, view: _View, rank: int, failed=(), repaired=False,
                census=()) -> FailureRecord:
        now = time.time()
        return FailureRecord(failed_ranks=tuple(sorted(failed)), size=len(view.members),
                             rank=view.members.index(rank), epoch=view.epoch, repaired=repaired,
                             census=tuple(census), started_s=now, finished_s=now)

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise FakeHang(f"{what}: no progress within {self.timeout_s} s "
                               f"(dead {sorted(self.dead)}, members {self.members})")
            self.cond.wait(min(left, 1.0))

    def _alive(self, rank: int) -> _View:
        if rank in self.dead:
            raise RankKilled(f"rank {rank} is dead")
        return self.views[rank]

    # -- data operations -------------------------------------------------------------------

    def allreduce(self, rank: int, tensor: torch.Tensor) -> FailureRecord:
        with self.cond:
            view = self._alive(rank)
            view.data_ops += 1
            kill = view.kill if view.kill and view.kill.ops == view.data_ops else None
            if kill is not None and not kill.contributed:
                self._die(rank, f"inside data operation {view.data_ops} before contributing")
            if view.generation < self.generation:
                # Another member repaired: this communicator is revoked, the operation fails.
                lost = self._repair(view)
                self.log.append(("revoked", rank, view.epoch))
                return self._record(view, rank, lost, repaired=True)
            key = (view.generation, view.seq)
            view.seq += 1
            slot = self.slots.setdefault(key, _Slot(key=key, members=view.members))
            slot.arrived[rank] = tensor.clone()
            if not bool(torch.isfinite(tensor).all()):
                self.nonfinite_sent.append((rank, key))
            if kill is not None:
                slot.victims.add(rank)
                slot.lucky |= set(kill.lucky)
                self._mark_dead(rank, f"inside data operation {view.data_ops} after contributing")
                self._resolve(slot)
                raise RankKilled(f"rank {rank} killed after contributing")
            self._wait(lambda: self._resolve(slot), f"rank {rank} all-reduce {key}")
            result = slot.results[rank]
            if isinstance(result, FailureRecord):
                return result
            tensor.copy_(result)
            return self._record(view, rank)

    def _resolve(self, slot: _Slot) -> bool:
        """Complete `slot` once every member arrived or can no longer arrive; True when done."""
        if slot.results is not None:
            return True
        missing = [r for r in slot.members if r not in slot.arrived]
        if any(r not in self.dead and not self._gone_past(r, slot.key) for r in missing):
            return False
        shapes = {t.shape for t in slot.arrived.values()}
        matched = not missing and len(shapes) == 1
        total = sum(slot.arrived.values()) if matched else None
        results = {}
        for r in slot.arrived:
            if r in slot.victims:
                continue
            if matched and (not slot.victims or r in slot.lucky):
                results[r] = total
            else:
                view = self.views[r]
                lost = self._repair(view)
                results[r] = self._record(view, r, lost, repaired=True)
        slot.results = results
        self.cond.notify_all()
        return True

    def _gone_past(self, rank: int, key: tuple[int, int]) -> bool:
        """`rank` will never post the operation `key`: it waits in a consensus, or it moved to
        a newer generation."""
        view = self.views[rank]
        return view.generation > key[0] or view.in_consensus

    # -- consensus -------------------------------------------------------------------------

    def consensus(self, rank: int, census) -> FailureRecord:
        with self.cond:
            view = self._alive(rank)
            if view.kill is not None and view.kill.ops == 0:
                self._die(rank, "inside consensus")
            view.in_consensus = True
            for slot in list(self.slots.values()):
                self._resolve(slot)  # operations still waiting for this member fail
            if view.generation < self.generation:
                self._repair(view)  # its agreement fails on the revoked communicator
            number = view.consensus_round
            view.consensus_round += 1
            state = self.rounds.setdefault(number, {"census": {}, "result": None})
            state["census"][rank] = list(census)
            self.cond.notify_all()
            self._wait(lambda: self._settle(state), f"rank {rank} consensus {number}")
            failed = tuple(r for r in view.at_consensus if r not in view.members)
            view.at_consensus = view.members
            return self._record(view, rank, failed, census=state["result"])

    def _settle(self, state: dict) -> bool:
        """Agree once every live member arrived: a repair removes the dead, every survivor
        leaves with the largest epoch, the summed census, and a fresh matching order (a new
        generation, so that operations after the consensus are matched from the start)."""
        if state["result"] is not None:
            return True
        if any(r not in state["census"] for r in self.members if r not in self.dead):
            return False
        alive = [r for r in state["census"] if r not in self.dead]
        for r in alive:
            if self.views[r].generation < self.generation or any(
                    m in self.dead for m in self.views[r].members):
                self._repair(self.views[r])  # its agreement failed: it repairs, then agrees
        self.generation += 1
        self.members = tuple(r for r in self.members if r not in self.dead)
        epoch = max(self.views[r].epoch for r in alive)
        for r in alive:
            view = self.views[r]
            view.generation, view.seq, view.in_consensus = self.generation, 0, False
            view.epoch, view.members = epoch, self.members
        width = len(state["census"][alive[0]])
        state["result"] = [sum(state["census"][r][i] for r in alive) for i in range(width)]
        self.cond.notify_all()
        return True

    # -- faults ----------------------------------------------------------------------------

    def arm(self, rank: int, ops: int, contributed: bool = False, lucky=()) -> None:
        """Kill `rank` inside its `ops`-th data operation from now (0: inside its next
        consensus); `contributed`: after its contribution went out, and the `lucky` survivors
        then complete that operation while the others repair."""
        with self.cond:
            view = self.views[rank]
            view.data_ops = 0
            view.kill = _Kill(ops, contributed, frozenset(lucky))


class FakeWork:
    def __init__(self, record: FailureRecord):
        self._record = record

    def wait(self, timeout_s: float | None = None) -> FailureRecord:
        return self._record

    def is_completed(self) -> bool:
        return True


class FakeGroup:
    """One member's handle, with `ULFMGroup`'s interface (what the recovery layer calls)."""

    def __init__(self, world: FakeWorld, rank: int):
        self.world = world
        self.world_rank = rank
        self.process_group = None

    @property
    def epoch(self) -> int:
        return self.world.views[self.world_rank].epoch

    @property
    def size(self) -> int:
        return len(self.world.views[self.world_rank].members)

    @property
    def rank(self) -> int:
        return self.world.views[self.world_rank].members.index(self.world_rank)

    @property
    def members(self) -> list[int]:
        return list(self.world.views[self.world_rank].members)

    def allreduce(self, tensor: torch.Tensor) -> FakeWork:
        return FakeWork(self.world.allreduce(self.world_rank, tensor))

    def consensus(self, census=()) -> FakeWork:
        return FakeWork(self.world.consensus(self.world_rank, [int(c) for c in census]))


class FakeTorchPlane(TorchPlaneGroup):
    """A member's handle on the torch data plane (`collective/torch_plane.py`) over a fake
    ulfm group: the plane's own protocol (a failed data operation only says `broken`, the
    consensus names the dead and rebuilds, the data epoch advances there) with the fake world's
    matching semantics standing in for gloo. Every rebuild succeeds, as no fake member dies
    inside one."""

    def __init__(self, control: FakeGroup):  # noqa: super().__init__ builds real groups
        self.control = control
        self._broken = True
        self._stuck = False
        self._data_epoch = -1
        self._data_members = []
        self._repair([])

    def allreduce(self, tensor: torch.Tensor) -> FakeWork:
        if self._broken:
            return FakeWork(self._record(broken=True))
        if self.control.allreduce(tensor).wait().has_failure:
            self._broken = True
            return FakeWork(self._record(broken=True))
        return FakeWork(self._record())

    def _rebuild(self) -> None:
        self._data_epoch += 1  # every survivor rebuilds after the same consensus
        self._data_members = self.control.members
        self._broken = False
