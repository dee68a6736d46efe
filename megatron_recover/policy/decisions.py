"""The records both policies produce and consume: per-replica work, iteration state, decisions.

Everything here is an immutable value. The policies are pure functions from
(state, agreed failure record) to (new state, decision), so every survivor that applies the same
record to the same state holds the same assignment without exchanging a message; nothing depends on
set or dict iteration order (replicas are always visited in increasing id).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from megatron_recover.policy.idset import IdSet
from megatron_recover.policy.layout import BOUNDARY_MINOR, PolicyConfig

BLOCKING = "blocking"
NON_BLOCKING = "non_blocking"


class NoSurvivorsError(RuntimeError):
    """Every replica is dead: there is nobody left to commit the iteration, the run must stop."""


@dataclass(frozen=True)
class ReplicaWork:
    """One live replica's share of the iteration in progress.

    replica: original replica id (0..W_init-1).
    base_role: its first-pass role after any promotion (major, minor, major_spare, minor_spare).
    slot: the layout slot it holds (major, minor) or shadows (exact-mode spare); None for a
        reserve-mode spare, which runs reserve-stream ids instead of shadowing.
    first_pass: the ids it runs in the first pass (for a spare: its shadow's or reserve ids).
    contributes_first_pass: False for an unpromoted spare, whose first-pass gradient is kept only
        in its snapshot (for a promotion) and never enters a reduce.
    extension: contributing ids of each extension round so far (every live replica takes part in
        every round, so the tuple has one entry per round, possibly empty).
    padding: non-contributing microbatches run so far to keep lockstep (one per round in which the
        replica was a boundary minor; the paper's boundary minors run the extra microbatch and zero
        it).
    boundary_minor: whether it is a boundary minor of the latest extension round.
    """

    replica: int
    base_role: str
    slot: int | None
    first_pass: IdSet
    contributes_first_pass: bool
    extension: tuple[IdSet, ...] = ()
    padding: int = 0
    boundary_minor: bool = False

    @property
    def role(self) -> str:
        """The role reported for the iteration: boundary_minor in a round that made it one."""
        return BOUNDARY_MINOR if self.boundary_minor else self.base_role

    @property
    def held(self) -> IdSet:
        """The ids it contributes if the iteration commits now (uncommitted until then)."""
        first = self.first_pass if self.contributes_first_pass else IdSet()
        return IdSet.union_all((first,) + self.extension)

    @property
    def ran_ids(self) -> IdSet:
        """Every id it has run in this iteration (first pass and extension rounds)."""
        return IdSet.union_all((self.first_pass,) + self.extension)

    @property
    def ran_count(self) -> int:
        """Microbatches it has run: first pass, extension ids and padding."""
        return len(self.first_pass) + sum(len(ids) for ids in self.extension) + self.padding


@dataclass(frozen=True)
class IterationState:
    """The agreed assignment of one iteration, from its start up to its commit.

    layout: the policy's layout in force when the iteration started (static: `Layout`; adaptive:
        `AdaptiveLayout`); both expose g_cur and r_cur.
    work: live replica -> its ReplicaWork. Dead replicas are removed.
    failed: replicas that died since the iteration started (the union of the applied records).
    promotions: (dead replica, promoted spare) pairs, in the order they were made.
    rounds: G_ext of each extension round so far; empty means no policy boundary (yet).
    reserve_next: the first reserve-stream index not yet handed out (reserve mode).
    """

    config: PolicyConfig
    iteration: int
    layout: Any
    work: Mapping[int, ReplicaWork]
    failed: frozenset[int] = frozenset()
    promotions: tuple[tuple[int, int], ...] = ()
    rounds: tuple[int, ...] = ()
    reserve_next: int = 0

    @property
    def b(self) -> int:
        """The iteration's B: the microbatch gradients a committed static iteration holds."""
        return self.config.b_at(self.iteration)

    @property
    def live(self) -> tuple[int, ...]:
        """Live replicas, increasing."""
        return tuple(sorted(self.work))

    @property
    def round(self) -> int:
        """0 during the first pass, k during the k-th extension pass."""
        return len(self.rounds)

    @property
    def boundary(self) -> bool:
        """Whether this iteration crossed a policy boundary (has an extension pass)."""
        return bool(self.rounds)

    def contributions(self) -> int:
        """C_cur: how many ids the live replicas would commit now (the census total)."""
        return sum(len(self.work[r].held) for r in self.live)


@dataclass(frozen=True)
class PolicyDecision:
    """A policy's answer to one agreed failure record.

    restore_mode: "blocking" (rewind stale buckets and re-reduce before the optimizer step) or
        "non_blocking" (a new extension pass reduces everything again; rewind overlaps with it).
    g_ext: microbatches of the new extension round (0: no new round).
    num_boundary_minor: boundary minors of the new round (they run g_ext, contribute g_ext - 1).
    promotions: (dead replica, promoted spare) pairs made for this record.
    pool: how many ids went back to the pool (recomputed in the new round, or fresh reserve ids).
    dropped: how many uncommitted ids were dropped for good (adaptive policy).
    """

    restore_mode: str
    g_ext: int = 0
    num_boundary_minor: int = 0
    promotions: tuple[tuple[int, int], ...] = ()
    pool: int = 0
    dropped: int = 0

    @property
    def boundary(self) -> bool:
        """Whether this record started a new extension round."""
        return self.g_ext > 0


@dataclass(frozen=True)
class IterationResult:
    """What an iteration committed, and the layout the next iteration starts from.

    Per-replica maps hold exactly the replicas alive at the commit, in increasing id.
    divisor: what the summed gradient is divided by (static: B; adaptive: the committed count).
    next_layout / next_reserve: the state the next iteration begins with.
    evicted: replicas the measured speeds evicted at this commit (`speed.py`): not in
        next_layout. slow: the replicas the next layout treats as slow. ratios: each measured
        replica's time per microbatch over the median of the others'.
    """

    iteration: int
    grad_accum: int
    minor_microbatches: int
    roles: dict[int, str]
    ran: dict[int, int]
    ran_ids: dict[int, IdSet]
    per_replica_ids: dict[int, IdSet]
    committed: IdSet
    divisor: int
    extension_rounds: tuple[int, ...]
    promotions: tuple[tuple[int, int], ...]
    failed: frozenset[int]
    next_layout: Any = field(repr=False)
    next_reserve: int = 0
    evicted: frozenset[int] = frozenset()
    slow: frozenset[int] = frozenset()
    ratios: Mapping[int, float] = field(default_factory=dict)

    @property
    def contributions(self) -> int:
        return len(self.committed)

    @property
    def boundary(self) -> bool:
        return bool(self.extension_rounds)

    @property
    def extra_microbatches(self) -> int:
        """How far P(major) grew in this iteration: the sum of G_ext over its extension rounds."""
        return sum(self.extension_rounds)


@dataclass(frozen=True)
class RankWork:
    """What one replica must do in the iteration in progress (the schedules' query).

    first_pass: ids to run in the first pass, in increasing order.
    contributes_first_pass: whether the first-pass gradient enters the reduce; False for a spare,
        whose gradient is snapshotted (for a promotion) and zeroed at reduce time.
    extension: ids to run in the current extension pass (empty outside a policy boundary); every
        one of them contributes.
    extension_padding: non-contributing microbatches to run after `extension` in the current pass
        (1 for a boundary minor); each re-runs `padding_id` and its gradient is discarded.
    contributed: the ids this replica contributes if the iteration commits now.
    """

    replica: int
    iteration: int
    role: str
    first_pass: IdSet
    contributes_first_pass: bool
    extension: IdSet
    extension_padding: int
    padding_id: int
    contributed: IdSet

    @property
    def num_microbatches(self) -> int:
        """Microbatches of the first pass."""
        return len(self.first_pass)

    @property
    def extension_microbatches(self) -> int:
        """Microbatches of the current extension pass, padding included."""
        return len(self.extension) + self.extension_padding


def rank_work(state: IterationState, replica: int) -> RankWork:
    """The RankWork of a live replica in `state`."""
    if replica not in state.work:
        raise ValueError(f"replica {replica} is not live in iteration {state.iteration}")
    work = state.work[replica]
    in_extension = state.round > 0
    return RankWork(
        replica=replica,
        iteration=state.iteration,
        role=work.role,
        first_pass=work.first_pass,
        contributes_first_pass=work.contributes_first_pass,
        extension=work.extension[-1] if in_extension else IdSet(),
        extension_padding=1 if in_extension and work.boundary_minor else 0,
        padding_id=work.first_pass.first(),
        contributed=work.held,
    )


def check_failed(state: IterationState, failed: Iterable[int]) -> frozenset[int]:
    """Validate an agreed failure record against `state`; return it as a frozenset.

    Raises ValueError for an empty record or one naming a replica that is not live, and
    NoSurvivorsError when it names every live replica.
    """
    failed = frozenset(failed)
    if not failed:
        raise ValueError("a failure record must name at least one replica")
    w_init = state.config.w_init
    for replica in sorted(failed):
        if not 0 <= replica < w_init:
            raise ValueError(f"replica {replica} does not exist (replicas are 0..{w_init - 1})")
        if replica not in state.work:
            raise ValueError(f"replica {replica} is not live in iteration {state.iteration}")
    if failed >= set(state.work):
        raise NoSurvivorsError(
            f"every replica is dead in iteration {state.iteration}: the run cannot continue "
            "(at least one replica must survive)"
        )
    return failed


def commit_maps(state: IterationState) -> dict[str, Any]:
    """The per-replica maps of an IterationResult, built from the live replicas of `state`."""
    live = state.live
    per_replica_ids = {r: state.work[r].held for r in live}
    committed = IdSet.union_all(per_replica_ids.values())
    # Each id is committed by one replica only: the parts must add up to the union.
    assert sum(len(ids) for ids in per_replica_ids.values()) == len(committed), "id committed twice"
    return dict(
        roles={r: state.work[r].role for r in live},
        ran={r: state.work[r].ran_count for r in live},
        ran_ids={r: state.work[r].ran_ids for r in live},
        per_replica_ids=per_replica_ids,
        committed=committed,
    )
