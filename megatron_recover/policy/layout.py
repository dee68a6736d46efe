"""Roles, the run's policy configuration, and the static policy's steady-state layout.

A layout is what a replica needs to know before an iteration starts: G_cur, R_cur and which live
replica plays which role. Microbatch ids follow from it (docs/design.md, "Exact semantics"):
the majors, in replica order, take the contiguous ranges [i*G_cur, (i+1)*G_cur) and the minor takes
the remainder [n_maj*G_cur, B). Those ranges are *slots*; slot i < n_maj belongs to the i-th major,
slot n_maj to the minor. In exact mode a spare shadows a slot: it runs that slot's ids so that it
can be promoted into it without recomputing anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from megatron_recover.policy.idset import IdSet
from megatron_recover.policy.speed import StragglerConfig

MAJOR = "major"
MINOR = "minor"
MAJOR_SPARE = "major_spare"
MINOR_SPARE = "minor_spare"
BOUNDARY_MINOR = "boundary_minor"
ROLES = (MAJOR, MINOR, MAJOR_SPARE, MINOR_SPARE, BOUNDARY_MINOR)

STATIC = "static"
ADAPTIVE = "adaptive"
EXACT = "exact"
RESERVE = "reserve"


@dataclass(frozen=True)
class PolicyConfig:
    """What every replica must agree on at launch; validated here, once.

    w_init: number of replicas at launch (cross-replica group size), >= 1.
    g_init: microbatches per replica per iteration at launch (gradient accumulation), >= 1.
    policy: "static" (the paper's Algorithms 6 and 7; the batch stays B) or "adaptive"
        (Algorithm 8, drop-and-go: the batch shrinks with the world).
    mode: "exact" (default; spares shadow ids, lost ids are recomputed, so every iteration commits
        the failure-free ids) or "reserve" (the paper's behaviour: spares run ids of a separate
        reserve stream, a dead replica's ids are dropped). Only the static policy has modes.
    ramp: B of each iteration before the last step of a batch-size schedule
        (--step-batch-size-schedule), iteration 1 first, non-decreasing, each a multiple of
        w_init and at most B; every later iteration has B. Empty: B in every iteration.
    straggler: how the static policy's layout follows the replicas' measured speed
        (`speed.StragglerConfig`; the default measures nothing and never moves work).
    """

    w_init: int
    g_init: int
    policy: str = STATIC
    mode: str = EXACT
    ramp: tuple[int, ...] = ()
    straggler: StragglerConfig = StragglerConfig()

    def __post_init__(self):
        for name in ("w_init", "g_init"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.policy not in (STATIC, ADAPTIVE):
            raise ValueError(f"policy must be 'static' or 'adaptive', got {self.policy!r}")
        if self.mode not in (EXACT, RESERVE):
            raise ValueError(f"mode must be 'exact' or 'reserve', got {self.mode!r}")
        if self.policy == ADAPTIVE and self.mode != EXACT:
            # Drop-and-go has no spares, so there is nothing for a reserve stream to feed.
            raise ValueError("reserve mode applies to the static policy only")
        if self.policy == ADAPTIVE and self.straggler.enabled:
            # Drop-and-go gives every replica the same slice; only the static layout can move it.
            raise ValueError("straggler balancing and eviction apply to the static policy only")
        ramp = tuple(self.ramp)
        object.__setattr__(self, "ramp", ramp)
        if any(not 1 <= b <= self.b or b % self.w_init for b in ramp) or list(ramp) != sorted(
                ramp):
            raise ValueError(f"ramp must be non-decreasing multiples of w_init={self.w_init} up "
                             f"to B={self.b}, got {ramp}")

    @property
    def b(self) -> int:
        """B, the global microbatch count per iteration after any ramp-up: W_init x G_init.
        Reserve-stream ids start here (id B + j), whatever the iteration's own B."""
        return self.w_init * self.g_init

    def b_at(self, iteration: int) -> int:
        """The global microbatch count of `iteration` (its B; smaller during a ramp-up)."""
        if iteration < 1:
            raise ValueError(f"iterations are numbered from 1, got {iteration}")
        return self.ramp[iteration - 1] if iteration <= len(self.ramp) else self.b


@dataclass(frozen=True)
class Layout:
    """The static policy's role layout in force at the start of an iteration.

    b: B. g_cur: microbatches of a major. r_cur: microbatches of the minor (0: no minor).
    majors, major_spares, minor_spares: replica ids, each tuple increasing. minor: a replica id or
    None. Invariants: n_maj*g_cur + r_cur == B, 0 <= r_cur < g_cur, the roles are disjoint, and a
    minor-spare exists only beside a minor.
    quotas: a balanced layout's microbatches of each major, in the majors' order (`speed.py`):
        every live replica is a major, with no minor and no spares; the quotas sum to B, each is
        at least 1, and g_cur is the largest. Empty: every major runs g_cur.
    """

    b: int
    g_cur: int
    r_cur: int
    majors: tuple[int, ...]
    minor: int | None
    major_spares: tuple[int, ...] = ()
    minor_spares: tuple[int, ...] = ()
    quotas: tuple[int, ...] = ()

    def __post_init__(self):
        if self.quotas:
            assert len(self.quotas) == len(self.majors) and min(self.quotas) >= 1, self
            assert sum(self.quotas) == self.b and self.g_cur == max(self.quotas), self
            assert self.minor is None and not self.major_spares and not self.minor_spares, self
        else:
            assert len(self.majors) * self.g_cur + self.r_cur == self.b, self
        assert 0 <= self.r_cur < self.g_cur, self
        assert (self.minor is None) == (self.r_cur == 0), self
        assert self.majors, "the static policy always has a major"
        assert not self.minor_spares or self.minor is not None, self
        # Each major-spare shadows its own major. Algorithm 7 never makes more spares than majors
        # (spares*G_cur < W_cur <= B < (n_maj+1)*G_cur), and promotions only remove spares.
        assert len(self.major_spares) <= len(self.majors), self
        for group in (self.majors, self.major_spares, self.minor_spares):
            assert list(group) == sorted(set(group)), self
        assert len(self.replicas) == len(set(self.replicas)), self

    @property
    def replicas(self) -> tuple[int, ...]:
        """Every live replica of the layout, increasing."""
        minor = () if self.minor is None else (self.minor,)
        return tuple(sorted(self.majors + minor + self.major_spares + self.minor_spares))

    @property
    def minor_slot(self) -> int:
        """The slot index of the minor's range (== n_maj)."""
        return len(self.majors)

    def role_of(self, replica: int) -> str:
        """The role of a replica of this layout."""
        if replica in self.majors:
            return MAJOR
        if replica == self.minor:
            return MINOR
        if replica in self.major_spares:
            return MAJOR_SPARE
        if replica in self.minor_spares:
            return MINOR_SPARE
        raise ValueError(f"replica {replica} is not part of this layout")

    def slot_of(self, replica: int) -> int:
        """The slot a replica holds (major, minor) or shadows (spares).

        The k-th major-spare shadows the k-th major; the minor-spare shadows the minor.
        """
        role = self.role_of(replica)
        if role == MAJOR:
            return self.majors.index(replica)
        if role == MAJOR_SPARE:
            return self.major_spares.index(replica)
        return self.minor_slot

    def slot_ids(self, slot: int) -> IdSet:
        """The microbatch ids of a slot."""
        assert 0 <= slot <= self.minor_slot, slot
        if self.quotas:
            start = sum(self.quotas[:slot])
            return IdSet.range(start, start + self.quotas[slot])
        if slot < self.minor_slot:
            return IdSet.range(slot * self.g_cur, (slot + 1) * self.g_cur)
        assert self.minor is not None, "no minor slot in this layout"
        return IdSet.range(self.minor_slot * self.g_cur, self.b)

    def first_pass_ids(self, replica: int) -> IdSet:
        """Exact mode: the ids a replica runs in its first pass (its slot or the one it shadows)."""
        return self.slot_ids(self.slot_of(replica))


def initial_layout(config: PolicyConfig) -> Layout:
    """The launch layout: W_init majors sharing iteration 1's B (G_init without a ramp-up), no
    minor, no spares."""
    b = config.b_at(1)
    return Layout(
        b=b, g_cur=b // config.w_init, r_cur=0, majors=tuple(range(config.w_init)), minor=None
    )


def advance_layout(live: Iterable[int], b: int) -> Layout:
    """Algorithm 7 (POLICY_ADVANCEMENT), exactly as the paper writes it.

    G_cur is the smallest integer with W_cur*G_cur >= B; n_maj = floor(B/G_cur); one minor takes
    R_cur = B - n_maj*G_cur when that is non-zero; the rest are spares, one of them a minor-spare
    when n_min == 1 and W_cur - n_maj - n_min >= 2, otherwise all major-spares. Roles go out in
    replica order: majors first, then the minor, the major-spares, and the minor-spare last (so the
    paper's Figure 5 example, 0-based, has majors 0-27, minor 28, major-spare 29, minor-spare 30).
    """
    order = sorted(set(live))
    w_cur = len(order)
    if w_cur < 1:
        raise ValueError("advance_layout needs at least one live replica")
    g_cur = -(-b // w_cur)
    n_maj = b // g_cur
    r_cur = b - n_maj * g_cur
    n_min = 1 if r_cur else 0
    rest = w_cur - n_maj - n_min
    # n_maj + n_min <= W_cur because W_cur*G_cur >= B; so rest is never negative.
    assert rest >= 0, (w_cur, b)
    n_minor_spare = 1 if n_min == 1 and rest >= 2 else 0
    majors = tuple(order[:n_maj])
    minor = order[n_maj] if n_min else None
    spares = order[n_maj + n_min :]
    return Layout(
        b=b,
        g_cur=g_cur,
        r_cur=r_cur,
        majors=majors,
        minor=minor,
        major_spares=tuple(spares[: rest - n_minor_spare]),
        minor_spares=tuple(spares[rest - n_minor_spare :]),
    )


def balanced_layout(quotas: dict[int, int], b: int) -> Layout:
    """A layout in which every replica of `quotas` (replica -> microbatches, summing to `b`) is a
    major with its own quota: majors take contiguous id ranges in replica order, as always."""
    majors = tuple(sorted(quotas))
    return Layout(b=b, g_cur=max(quotas.values()), r_cur=0, majors=majors, minor=None,
                  quotas=tuple(quotas[r] for r in majors))
