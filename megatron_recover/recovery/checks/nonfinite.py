"""Non-finite reruns as a registered check (--recover-nonfinite-rerun evict|keep).

A replica whose first-pass bucket fails Megatron's NaN/inf check holds its gradient out of the
reduction (it sends zeros, as a spare does) and says so in its lane segment; the check holds the
round. Every replica learns the suspects; each suspect reruns its ids in place and its checker
runs them too (`rerun.checkers`), and their findings ride in the next round's lane. Then every
replica reaches the same outcome (`rerun.classify`, the table of `rerun.py`): evict the suspect
or the checker, keep a transient fault's rerun, or end the job on data that is non-finite
anywhere. A failure that interrupts the reruns makes the suspects leave, as without reruns.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_recover.errors import NonFiniteData, NonFiniteResult
from megatron_recover.recovery.checks.base import HOLD, Check, COMMIT
from megatron_recover.recovery.rerun import (
    CHECKER,
    DATA,
    KEEP,
    PERSISTENT,
    TRANSIENT,
    UNKNOWN,
    RerunSlots,
    RerunView,
    checkers,
    classify,
)


class NonfiniteReruns(Check):
    """`mode`: evict or keep (`rerun.MODES`); `samples_of(iteration, k)`: the samples of id k,
    for the message that ends a job on data (None: the message gives the ids alone)."""

    name = "nonfinite-reruns"
    cause = "non-finite gradient"

    def __init__(self, w_init: int, mode: str, samples_of=None):
        self.mode = mode
        self.samples_of = samples_of
        self.slots = RerunSlots(w_init)
        self.lane_size = self.verdict_size = self.slots.size
        self._reruns: dict[int, int | None] = {}  # suspect -> its checker, reruns under way
        self._rerun_ids: dict[int, list[int]] = {}  # suspect -> its first-pass ids
        self._rerun_bad = RerunView()  # what this rank's reruns found non-finite
        self._kept: set[int] = set()  # suspects kept after a finite rerun, this iteration

    def begin(self, core, iteration):
        self._reruns, self._rerun_ids, self._rerun_bad, self._kept = {}, {}, RerunView(), set()

    def pass_mode(self, core, first):
        return {"hold_nonfinite": not core.extended}  # reruns classify first passes only

    def holds_own(self, core):
        return core.p.replica in self._reruns

    def lane(self, core, iteration, sent):
        return self.slots.encode(replace(
            self._rerun_bad,
            nonfinite=frozenset([core.p.replica] if core.recovery.nonfinite else [])))

    def view(self, core, iteration, lane, totals, head):
        return self.slots.encode(self.slots.decode(lane))

    def asks(self, core, verdict):
        held = self._reruns or self.slots.decode(verdict).nonfinite - core.dead_replicas
        return HOLD if held else COMMIT

    def act(self, core, iteration, verdict, events, detected):
        """Before reruns: each suspect reruns its ids in place and its checker runs them too
        (nothing to evict yet). After them (this round's lane carried their findings): the
        replicas to evict (this rank raises if its replica is one, and every rank raises when
        the microbatches themselves give a non-finite gradient); a transient fault kept
        (`keep`) contributes its rerun's gradient from the next round on."""
        p, reruns = core.p, self.slots.decode(verdict)
        if not self._reruns:
            suspects = sorted(reruns.nonfinite - core.dead_replicas)
            again = sorted(set(suspects) & self._kept)
            if again:  # kept after a finite rerun, non-finite again in the same iteration
                events.append({"event": "rerun", "outcomes": {str(n): PERSISTENT for n in again},
                               "evicted": again, "kept": [], "detected": detected})
                if p.replica in again:
                    raise NonFiniteResult(
                        f"iteration {iteration}: this replica's gradient was non-finite again "
                        "after its rerun had been kept: its device is taken for faulty; the "
                        "replica leaves before the commit")
                return again
            self._reruns = checkers(suspects, core.live())
            self._rerun_ids = {n: list(p.policy.work(n).first_pass) for n in suspects}
            events.append({"event": "nonfinite", "replicas": suspects,
                           "checkers": [self._reruns[n] for n in suspects],
                           "detected": detected})
            # A checker first (a suspect may check another when only suspects are left), then
            # the suspect's own rerun, which stays in its buckets.
            check_bad = frozenset(n for n in suspects if self._reruns[n] == p.replica
                                  and self._check_rerun(core, iteration, n))
            own_bad = frozenset(n for n in suspects if n == p.replica
                                and self._rerun(core, iteration, n))
            self._rerun_bad = RerunView(own_bad=own_bad, check_bad=check_bad)
            return []
        outcomes = {n: classify(n in reruns.own_bad, checker, n in reruns.check_bad)
                    for n, checker in self._reruns.items()}
        events.append({"event": "rerun", "outcomes": {str(n): o for n, o in outcomes.items()},
                       "checkers": {str(n): c for n, c in self._reruns.items()},
                       "detected": detected})
        data = sorted(n for n, o in outcomes.items() if o in (DATA, UNKNOWN))
        if data:
            raise NonFiniteData(self._data_message(iteration, data[0], self._reruns[data[0]]))
        evict = {n for n, o in outcomes.items()
                 if o == PERSISTENT or (o in (TRANSIENT, CHECKER) and self.mode != KEEP)}
        evict |= {self._reruns[n] for n, o in outcomes.items() if o == CHECKER}
        kept = sorted(set(outcomes) - evict)
        events[-1].update(evicted=sorted(evict), kept=kept)
        if p.replica in evict:
            raise NonFiniteResult(self._evicted_message(core, iteration, outcomes))
        self._reruns, self._rerun_bad = {}, RerunView()
        self._kept.update(kept)
        if p.replica in kept:
            core.recovery.keep_rerun()  # its buckets' snapshot holds the rerun's gradient
        return sorted(evict - core.dead_replicas)

    def on_failure(self, core, iteration, new_dead):
        """A replica died while suspects were being classified: the suspects leave too, as
        without reruns (their microbatches are redone with the dead replicas')."""
        if not self._reruns:
            return new_dead
        suspects = set(self._reruns) - core.dead_replicas
        self._reruns, self._rerun_bad = {}, RerunView()
        if core.p.replica in suspects:
            raise NonFiniteResult(
                f"iteration {iteration}: this replica's gradient was non-finite and a failure of "
                f"replica(s) {new_dead} interrupted its rerun: it leaves as without "
                "--recover-nonfinite-rerun")
        return sorted(set(new_dead) | suspects)

    def _rerun(self, core, iteration: int, suspect: int) -> bool:
        """This replica is `suspect`: run its first-pass ids again from empty buffers; whether
        the gradient is non-finite. The buckets keep the rerun's gradient: the next round's
        reductions snapshot it (and send zeros), so a kept replica contributes it afterwards."""
        core.run_for(iteration, self._rerun_ids[suspect])
        for check in core.checks:
            check.reran_own(core)
        return core.recovery.any_nonfinite()

    def _check_rerun(self, core, iteration: int, suspect: int) -> bool:
        """This replica checks `suspect`: run its ids from empty buffers; whether the gradient
        is non-finite. The buckets then hold it: the restore that follows rewinds them (or this
        replica's own rerun empties them first)."""
        core.run_for(iteration, self._rerun_ids[suspect])
        return core.recovery.any_nonfinite()

    def _evicted_message(self, core, iteration: int, outcomes: dict[int, str]) -> str:
        """Why this rank's replica is evicted after the reruns (`outcomes` by suspect)."""
        me = core.p.replica
        if me in outcomes:  # a suspect: persistent, or transient (its checker's run may
            # have failed too: CHECKER) and evicted as the flag asks
            why = ("again when this replica ran them a second time, and not on replica "
                   f"{self._reruns[me]}: its device is taken for faulty"
                   if outcomes[me] == PERSISTENT else
                   "once, not when this replica ran them again: a transient fault, evicted as "
                   "--recover-nonfinite-rerun evict asks")
            ids = self._rerun_ids[me]
        else:
            suspect = next(n for n, o in outcomes.items()
                           if o == CHECKER and self._reruns[n] == me)
            ids = self._rerun_ids[suspect]
            why = (f"when this replica ran them, and not when replica {suspect}, whose "
                   "microbatches they are, ran them again: its device is taken for faulty")
        return (f"iteration {iteration}: microbatches {ids} gave a non-finite gradient {why}; "
                "the replica leaves before the commit")

    def _data_message(self, iteration: int, suspect: int, checker: int | None) -> str:
        ids = self._rerun_ids[suspect]
        where = (f"on replica {suspect} twice and on replica {checker}" if checker is not None
                 else f"on replica {suspect} twice, and no other replica is left to tell the "
                      "data from the device")
        samples = ""
        if self.samples_of is not None:
            ranges = [self.samples_of(iteration, k) for k in ids]
            samples = " (samples " + ", ".join(
                f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in ranges) + ")"
        return (f"iteration {iteration}: microbatches {ids}{samples} give a non-finite gradient "
                f"{where}: the data or the model's state is at fault, not a device; nothing of "
                "the iteration is committed")
