"""Stragglers: the static policy's layout follows the replicas' measured speed.

A slow GPU or link makes every iteration wait for the slowest replica at the gradient reduction.
The versatile workload can give a slow replica fewer microbatches and the others more while the
iteration still commits exactly B of them (in exact mode: ids 0..B-1, each once), so the job runs
at the speed of its total capacity.

Every replica measures its first pass's compute time per microbatch and the commit lane carries
it, so every survivor holds the same per-replica times after every committed iteration
(`observe`'s input). From those times alone, with the same rules on every rank:

- A replica is *slow* in an iteration when its time per microbatch exceeds the median of the
  other measured replicas' by more than `threshold` (0.25: 25 % slower). Work moves only when a
  replica has been slow for `window` consecutive iterations; it moves back when every replica
  marked slow has been within the threshold for `window` consecutive iterations (hysteresis: a
  single slow iteration moves nothing, and neither does noise below the threshold).
- While some replica is marked slow, the layout gives every live replica an integer quota of the
  B ids in replica order (`balanced_quotas`): at least one each, the largest finish time
  (quota x time per microbatch) as small as it can be, so the quotas are roughly proportional
  to speed. A marked replica's time is its mean over the window; every other replica counts at
  the median of their means, so noise between healthy replicas moves nothing. The quotas are recomputed when the marked set
  changes, after the live set changed (a failure or a join), and when the window's speeds
  predict a finish time shorter by more than `threshold` than the current quotas'.
- A replica slower than `evict_slower_than` times the median of the others for `window`
  consecutive iterations is *evicted*: fail-slow becomes fail-stop, it leaves as a failed replica
  does (a standby, if any, takes its id).

Nothing here reads a clock: `observe` is a pure function of the agreed times, so every survivor
reaches the same layout. Exactness never depends on timing: a quota layout is a layout like any
other, and a failure in it is recovered as without balancing.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Mapping

# StragglerConfig.window's default (--recover-straggler-window, plan's --straggler-window).
DEFAULT_WINDOW = 5


@dataclass(frozen=True)
class StragglerConfig:
    """The straggler settings every replica agrees on at launch.

    threshold: how much slower than the median of the others a replica must be to count as slow
        (a fraction: 0.25 means 25 %); 0 turns balancing off.
    window: consecutive iterations a replica must be slow (or back within the threshold) before
        work moves (or moves back), and slower than `evict_slower_than` before it is evicted;
        at least 2.
    evict_slower_than: a factor over the median of the others (for example 3.0); 0 never evicts.
    """

    threshold: float = 0.0
    window: int = DEFAULT_WINDOW
    evict_slower_than: float = 0.0

    def __post_init__(self):
        if not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold!r}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 2:
            raise ValueError(f"window must be an integer >= 2 (one slow iteration never moves "
                             f"work), got {self.window!r}")
        if self.evict_slower_than and not self.evict_slower_than > 1 + self.threshold:
            raise ValueError(f"evict_slower_than must be above 1 + threshold = "
                             f"{1 + self.threshold:g} (or 0: never), got {self.evict_slower_than!r}")

    @property
    def balancing(self) -> bool:
        return self.threshold > 0

    @property
    def evicting(self) -> bool:
        return self.evict_slower_than > 0

    @property
    def enabled(self) -> bool:
        """Whether replicas measure and report their speed at all."""
        return self.balancing or self.evicting


@dataclass(frozen=True)
class Streaks:
    """One replica's recent history: its latest `window` times per microbatch (seconds, oldest
    first) and how many consecutive measured iterations it was slow, within the threshold, and
    past the eviction factor."""

    times: tuple[float, ...] = ()
    slow: int = 0
    within: int = 0
    evictable: int = 0


@dataclass(frozen=True)
class SpeedState:
    """What `observe` carries from one iteration to the next, equal on every rank.

    replicas: replica id -> its Streaks (live replicas that were measured at least once).
    marked: the replicas currently treated as slow (balancing is on while it is not empty).
    quotas: the quotas in force (replica -> microbatches), empty while the layout is not balanced.
    """

    replicas: Mapping[int, Streaks] = field(default_factory=dict)
    marked: frozenset[int] = frozenset()
    quotas: Mapping[int, int] = field(default_factory=dict)

    def forget(self, replicas: Iterable[int]) -> "SpeedState":
        """The state without `replicas` (dead, or their ids taken by joining standbys, whose
        speed is not the old replica's). The quotas are dropped: the live set changed."""
        gone = set(replicas)
        return SpeedState(replicas={r: s for r, s in self.replicas.items() if r not in gone},
                          marked=self.marked - gone, quotas={})


@dataclass(frozen=True)
class SpeedDecision:
    """What an iteration's times decided for the next layout.

    quotas: replica -> microbatches of a balanced layout, or None for the plain layout
        (Algorithm 7). evict: replicas to evict now. ratios: each measured replica's time over
        the median of the others' (for the logs).
    """

    quotas: Mapping[int, int] | None
    evict: frozenset[int] = frozenset()
    ratios: Mapping[int, float] = field(default_factory=dict)


def ratios(times: Mapping[int, float]) -> dict[int, float]:
    """Each replica's time per microbatch over the median of the other replicas' (none without
    another measured replica)."""
    out = {}
    for replica, t in sorted(times.items()):
        others = [times[r] for r in sorted(times) if r != replica]
        if others:
            out[replica] = t / statistics.median(others)
    return out


def balanced_quotas(b: int, times: Mapping[int, float]) -> dict[int, int] | None:
    """Integer quotas summing to `b`, at least one per replica, that minimise the largest
    quota x time (greedy: each further microbatch goes where it finishes first, ties to the lower
    replica id), hence roughly proportional to speed. None when `b` cannot give every replica
    one microbatch."""
    replicas = sorted(times)
    if not replicas or b < len(replicas):
        return None
    if any(not times[r] > 0 for r in replicas):
        raise ValueError(f"times per microbatch must be positive, got {dict(times)}")
    quotas = {r: 1 for r in replicas}
    heap = [(2 * times[r], r) for r in replicas]
    heapq.heapify(heap)
    for _ in range(b - len(replicas)):
        _, r = heapq.heappop(heap)
        quotas[r] += 1
        heapq.heappush(heap, ((quotas[r] + 1) * times[r], r))
    return quotas


def makespan(quotas: Mapping[int, int], times: Mapping[int, float]) -> float:
    """The slowest replica's predicted first pass: max over replicas of quota x time."""
    return max(quotas[r] * times[r] for r in quotas)


def observe(config: StragglerConfig, state: SpeedState, times: Mapping[int, float],
            live: Iterable[int], b: int) -> tuple[SpeedState, SpeedDecision]:
    """One committed iteration's agreed times per microbatch (replica -> seconds; replicas that
    ran no first-pass microbatch are absent) over the `live` replicas at the commit; `b`: the
    next iteration's B. Returns the next state and the decision for the next layout."""
    live = sorted(set(live))
    times = {r: float(t) for r, t in times.items() if r in live and t > 0}
    measured = ratios(times)
    replicas = {r: s for r, s in state.replicas.items() if r in live}
    for r, ratio in measured.items():
        s = replicas.get(r, Streaks())
        slow = config.balancing and ratio > 1 + config.threshold
        replicas[r] = Streaks(
            times=(s.times + (times[r],))[-config.window:],
            slow=s.slow + 1 if slow else 0,
            within=0 if slow else s.within + 1,
            evictable=s.evictable + 1 if config.evicting and ratio > config.evict_slower_than
            else 0)
    evict = _evictions(config, replicas, measured, live)
    marked = {r for r in state.marked if r in replicas and r not in evict
              and replicas[r].within < config.window}
    marked |= {r for r, s in replicas.items() if s.slow >= config.window and r not in evict}
    survivors = [r for r in live if r not in evict]
    quotas = None
    if marked:
        quotas = _quotas(config, state, replicas, marked, survivors, b)
    new_state = SpeedState(replicas={r: s for r, s in replicas.items() if r not in evict},
                           marked=frozenset(marked), quotas=dict(quotas or {}))
    return new_state, SpeedDecision(quotas=quotas, evict=frozenset(evict), ratios=measured)


def _evictions(config: StragglerConfig, replicas: Mapping[int, Streaks],
               measured: Mapping[int, float], live: list[int]) -> set[int]:
    """The replicas past the eviction factor for a window; never every live replica (the
    fastest of them stays)."""
    if not config.evicting:
        return set()
    evict = {r for r, s in replicas.items() if s.evictable >= config.window}
    if evict and evict >= set(live):
        evict.discard(min(evict, key=lambda r: (measured.get(r, 0.0), r)))
    return evict


def _quotas(config: StragglerConfig, state: SpeedState, replicas: Mapping[int, Streaks],
            marked: set[int], survivors: list[int], b: int) -> dict[int, int] | None:
    """The balanced quotas of the next layout: the ones in force unless the marked or live set
    changed or the window's means predict a finish shorter by more than the threshold."""
    means = {r: statistics.fmean(replicas[r].times) for r in survivors
             if r in replicas and replicas[r].times}
    if not means:
        return None
    # The replicas not marked slow count as equally fast (the median of their means): only a
    # marked replica's own speed moves work, never the noise between healthy ones. A replica
    # without a measurement (it never ran a first pass) counts as healthy.
    healthy = [means[r] for r in means if r not in marked] or list(means.values())
    typical = statistics.median(healthy)
    times = {r: means[r] if r in marked and r in means else typical for r in survivors}
    best = balanced_quotas(b, times)
    if best is None:
        return None
    current = dict(state.quotas)
    if (current and set(current) == set(survivors) and sum(current.values()) == b
            and frozenset(marked) == state.marked
            and makespan(best, times) >= makespan(current, times) * (1 - config.threshold)):
        return current
    return best

