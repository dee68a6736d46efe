"""Simulate a run of the policy under a failure schedule, one record per iteration.

A failure schedule is a list of `FailureEvent`s; each names replicas that die in an iteration and
in which phase:

- "reduce" (default): during the iteration's gradient synchronization, after every replica ran its
  first pass (the paper's hardest case: all that work is in flight);
- "extension": during the k-th extension pass of the iteration (k = 1 unless given); an error if
  the iteration has no such pass;
- "commit": after the iteration committed. Nobody learns of it until the next collective, which is
  the next iteration's reduce, so the replica is handled there as a "reduce" failure of the next
  iteration in which it ran nothing. It counts as this iteration's failure in `live_replicas`, and
  it is in this iteration's per-replica maps, because it did commit this iteration.

Events of the same iteration and phase form one agreed record. The simulator drives the very
`WorkloadPolicy` the training glue uses, so what `plan` prints is what a run would do.

Stragglers (`SlowReplica`, with a `StragglerConfig` in the policy's configuration) make a replica
take `factor` times as long per microbatch from one iteration on; every other replica takes 1.
The times are what the commit lane would carry, so the layout moves as a run's would, and a
replica the policy evicts is dead from the next iteration on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from megatron_recover.policy.layout import (
    BOUNDARY_MINOR,
    MAJOR,
    MAJOR_SPARE,
    MINOR,
    MINOR_SPARE,
    PolicyConfig,
)
from megatron_recover.policy.decisions import IterationResult, NoSurvivorsError
from megatron_recover.policy.workload import WorkloadPolicy

REDUCE = "reduce"
EXTENSION = "extension"
COMMIT = "commit"

_SPEC = re.compile(r"^(\d+):(\d+(?:,\d+)*)(?:@(reduce|commit|extension)(\d*))?$")
_SLOW = re.compile(r"^(\d+):(\d+(?:\.\d*)?)@(\d+)(?:-(\d+))?$")


@dataclass(frozen=True)
class SlowReplica:
    """Replica `replica` takes `factor` times as long per microbatch in iterations
    `first`..`last` (None: to the end)."""

    replica: int
    factor: float
    first: int
    last: int | None = None

    def factor_at(self, iteration: int) -> float:
        within = self.first <= iteration and (self.last is None or iteration <= self.last)
        return self.factor if within else 1.0


def parse_slow(spec: str) -> SlowReplica:
    """Parse `REPLICA:FACTOR@FIRST[-LAST]` (for example 2:2.0@3 or 1:3@2-6)."""
    match = _SLOW.match(spec.strip())
    if not match:
        raise ValueError(f"bad slowdown {spec!r}: expected REPLICA:FACTOR@FIRST[-LAST] "
                         "(e.g. 2:2.0@3, 1:3@2-6)")
    replica, factor, first, last = match.groups()
    slow = SlowReplica(int(replica), float(factor), int(first),
                       None if last is None else int(last))
    if slow.factor <= 0 or slow.first < 1 or (slow.last is not None and slow.last < slow.first):
        raise ValueError(f"bad slowdown {spec!r}: FACTOR > 0, 1 <= FIRST <= LAST")
    return slow


@dataclass(frozen=True)
class FailureEvent:
    """Replicas that die in `iteration` (1-based) during `phase`.

    extension_round: which extension pass, for phase "extension" (1 = the first); 0 otherwise.
    """

    iteration: int
    replicas: tuple[int, ...]
    phase: str = REDUCE
    extension_round: int = 0

    def __post_init__(self):
        if self.phase not in (REDUCE, EXTENSION, COMMIT):
            raise ValueError(f"unknown failure phase {self.phase!r}")
        if (self.phase == EXTENSION) != (self.extension_round >= 1):
            raise ValueError("extension_round >= 1 goes with phase 'extension', and only there")
        if not self.replicas:
            raise ValueError("a failure event names at least one replica")

    @property
    def label(self) -> str:
        """The phase as the CLI spells it."""
        if self.phase != EXTENSION:
            return self.phase
        return EXTENSION if self.extension_round == 1 else f"{EXTENSION}{self.extension_round}"


def parse_failure(spec: str) -> FailureEvent:
    """Parse `ITER:REPLICA[,REPLICA...][@PHASE]`, PHASE one of reduce, extension[N], commit."""
    match = _SPEC.match(spec.strip())
    if not match:
        raise ValueError(
            f"bad failure {spec!r}: expected ITER:REPLICA[,REPLICA...][@PHASE] with PHASE one of "
            "reduce, extension, commit (e.g. 3:5, 2:0,7@extension, 4:1@commit)"
        )
    iteration, replicas, phase, round_text = match.groups()
    phase = phase or REDUCE
    if phase != EXTENSION and round_text:
        raise ValueError(f"bad failure {spec!r}: only @extension takes a pass number")
    extension_round = (int(round_text) if round_text else 1) if phase == EXTENSION else 0
    if phase == EXTENSION and extension_round < 1:
        raise ValueError(f"bad failure {spec!r}: extension passes are numbered from 1")
    ids = [int(r) for r in replicas.split(",")]
    if len(set(ids)) != len(ids):
        raise ValueError(f"bad failure {spec!r}: a replica is named twice")
    return FailureEvent(int(iteration), tuple(ids), phase, extension_round)


@dataclass(frozen=True)
class IterationReport:
    """One simulated iteration: the policy's result plus what the run looked like around it."""

    result: IterationResult
    live_replicas: int
    failures: tuple[tuple[int, str], ...]  # (replica, phase) of the deaths in this iteration
    first_pass: tuple[tuple[int, int], ...] = ()  # (replica, microbatches it contributes first)

    def to_json(self) -> dict[str, Any]:
        """The machine-readable record `plan --json` prints (one per iteration).

        live_replicas: replicas alive after this iteration's failures (commit-phase ones included).
        grad_accum / minor_microbatches: G_cur and R_cur in force during the iteration, before any
        advancement. num_*: replicas per role as reported in `roles` (a boundary iteration reports
        its latest extension round's boundary minors). extra_microbatches: sum of G_ext over
        extension_rounds (0: no boundary). failed: replica -> phase of the deaths in this
        iteration; failures_handled: every death the policy handled in it (those after the
        previous commit included). promoted: dead replica -> spare that took its place.
        roles, ran, per_replica_ids, per_replica: maps over the replicas that committed this
        iteration; ran counts spare, extension and padding work. committed_ids: sorted union of
        per_replica_ids (ids >= B are reserve-stream microbatches, reserve mode only).
        """
        r = self.result
        counts = {role: 0 for role in (MAJOR, MINOR, MAJOR_SPARE, MINOR_SPARE, BOUNDARY_MINOR)}
        for role in r.roles.values():
            counts[role] += 1
        return {
            "iteration": r.iteration,
            "live_replicas": self.live_replicas,
            "grad_accum": r.grad_accum,
            "num_major": counts[MAJOR],
            "num_minor": counts[MINOR],
            "num_major_spare": counts[MAJOR_SPARE],
            "num_minor_spare": counts[MINOR_SPARE],
            "num_boundary_minor": counts[BOUNDARY_MINOR],
            "minor_microbatches": r.minor_microbatches,
            "boundary": r.boundary,
            "extra_microbatches": r.extra_microbatches,
            "extension_rounds": list(r.extension_rounds),
            "contributions": r.contributions,
            "divisor": r.divisor,
            "failed": {str(rep): phase for rep, phase in self.failures},
            "failures_handled": sorted(r.failed),
            "promoted": {str(dead): spare for dead, spare in r.promotions},
            "roles": {str(rep): role for rep, role in r.roles.items()},
            "ran": {str(rep): n for rep, n in r.ran.items()},
            "per_replica_ids": {str(rep): ids.to_list() for rep, ids in r.per_replica_ids.items()},
            "per_replica": {str(rep): len(ids) for rep, ids in r.per_replica_ids.items()},
            "committed_ids": r.committed.to_list(),
            "first_pass": {str(rep): n for rep, n in self.first_pass},
            "slow": sorted(r.slow),
            "evicted": sorted(r.evicted),
        }


def simulate(
    config: PolicyConfig, iterations: int, failures: Iterable[FailureEvent] = (),
    slow: Iterable[SlowReplica] = (),
) -> list[IterationReport]:
    """Run iterations 1..`iterations` under `failures` and slowdowns `slow`; return one report
    per iteration.

    Raises ValueError for a schedule that cannot happen (an iteration out of range, a replica that
    does not exist or is already dead, an extension pass the iteration does not have) and
    NoSurvivorsError when the schedule kills every replica.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    records = _group(config, iterations, failures)
    slow = list(slow)
    for s in slow:
        if not 0 <= s.replica < config.w_init:
            raise ValueError(f"slowdown of replica {s.replica}: replicas are "
                             f"0..{config.w_init - 1}")
    policy = WorkloadPolicy(config)
    dead: dict[int, str] = {}
    news: list[int] = []
    reports = []
    for t in range(1, iterations + 1):
        state = policy.begin(t)
        first_pass = tuple((r, len(w.first_pass)) for r, w in sorted(state.work.items())
                           if w.contributes_first_pass)
        failed_now: list[tuple[int, str]] = []
        first = records.pop((t, REDUCE, 0), [])
        _mark_dead(dead, first, t, REDUCE, failed_now)
        if news or first:
            policy.on_failure(news + first)
        for key in sorted(k for k in records if k[0] == t and k[1] == EXTENSION):
            round_ = key[2]
            if policy.state.round != round_:
                raise ValueError(_no_extension_message(t, round_, policy.state.round))
            replicas = records.pop(key)
            _mark_dead(dead, replicas, t, f"{EXTENSION}{'' if round_ == 1 else round_}", failed_now)
            policy.on_failure(replicas)
        times = {r: 1.0 for r in policy.state.live}
        for s in slow:
            if s.replica in times:
                times[s.replica] *= s.factor_at(t)
        result = policy.commit(times)
        for replica in sorted(result.evicted):
            dead[replica] = f"iteration {t} (evicted as a straggler)"
        news = records.pop((t, COMMIT, 0), [])
        _mark_dead(dead, news, t, COMMIT, failed_now)
        live = len(result.roles) - len(news) - len(result.evicted)
        if live == 0:
            raise NoSurvivorsError(
                f"every replica is dead after iteration {t} commits: the run cannot continue "
                "(at least one replica must survive)"
            )
        reports.append(IterationReport(result, live, tuple(failed_now), first_pass))
    assert not records, records
    return reports


def _group(config: PolicyConfig, iterations: int, failures: Iterable[FailureEvent]):
    """Merge events into one record per (iteration, phase, extension round); validate ids."""
    records: dict[tuple[int, str, int], list[int]] = {}
    for event in failures:
        where = f"{event.iteration}:{','.join(map(str, event.replicas))}@{event.label}"
        if not 1 <= event.iteration <= iterations:
            raise ValueError(f"failure {where}: iteration must be in 1..{iterations}")
        for replica in event.replicas:
            if not 0 <= replica < config.w_init:
                raise ValueError(
                    f"failure {where}: replica {replica} does not exist "
                    f"(replicas are 0..{config.w_init - 1})"
                )
        key = (event.iteration, event.phase, event.extension_round)
        merged = records.setdefault(key, [])
        for replica in event.replicas:
            if replica in merged:
                raise ValueError(f"failure {where}: replica {replica} is named twice")
            merged.append(replica)
    return records


def _mark_dead(dead, replicas, iteration, phase, failed_now) -> None:
    for replica in replicas:
        if replica in dead:
            raise ValueError(
                f"failure {iteration}:{replica}@{phase}: replica {replica} is already dead "
                f"(it failed in {dead[replica]})"
            )
        dead[replica] = f"iteration {iteration} @{phase}"
        failed_now.append((replica, phase))


def _no_extension_message(iteration: int, wanted: int, has: int) -> str:
    which = "extension pass" if wanted == 1 else f"extension pass {wanted}"
    why = (
        "no failure left ids to recompute (none happened, or spares absorbed them)"
        if has == 0
        else f"it has {has} extension pass{'es' if has > 1 else ''}"
    )
    return f"failure in iteration {iteration} @extension: the iteration has no {which}; {why}"
