"""Sampled cross-replica verification as a registered check (--recover-sdc-check-rate).

Each iteration a deterministic sample of the contributing replicas' first passes is run twice
(`verification.pairs`): by its owner, as always, and by a checker, before the checker's own
first pass and on empty buffers (so the own pass, and the trajectory, is the one without checks,
bit for bit). Both fingerprint what they hold, and the fingerprints ride in the lane segment.
A mismatch holds the round: a third live replica runs the owner's ids once more, its
fingerprint comes in the next round's lane, and the replica that disagrees with the other two
is evicted as a failed one before anything is committed; with no third replica, or three
different fingerprints, the job stops (`failures.UnresolvedCorruption`). `verification.py`
holds the pure parts (the sample, the projection, the judgement).
"""

from __future__ import annotations

import torch

from megatron_recover.errors import SilentCorruption, UnresolvedCorruption
from megatron_recover.recovery.checks.base import COMMIT, HOLD, Check
from megatron_recover.recovery.lane import replica_flags, replica_set
from megatron_recover.recovery.verification import (
    Fingerprint,
    Judgement,
    Slots,
    Verification,
    arbiter,
    judge,
    pairs,
    sum_fingerprints,
)

KINDS = ("suspects", "evict", "unresolved")  # the verdict segment: a flag per replica each


class SampledVerification(Check):
    name = "sdc"
    cause = "silent corruption"

    def __init__(self, w_init: int, verification: Verification):
        self.w_init = w_init
        self.verification = verification
        self.fingerprint = Fingerprint(verification.seed)
        self.slots = Slots(w_init)
        self.lane_size = self.slots.size
        self.verdict_size = len(KINDS) * w_init
        self._checks: dict[int, int] = {}  # this iteration's owner -> checker
        self._check_ids: dict[int, list[int]] = {}  # owner -> its first-pass ids
        self._fingerprints: dict[str, dict[int, torch.Tensor]] = {}  # what this rank computed
        self._arbiters: dict[int, int] = {}  # owner -> the replica that arbitrates it
        self._judgement: Judgement | None = None

    def begin(self, core, iteration):
        """Which owners are checked this iteration, and by whom; this replica runs the first
        pass of the owner it checks from empty buffers, fingerprints it and empties the buffers
        again, so its own pass starts as it would without checks."""
        p, verify = core.p, self.verification
        self._checks, self._check_ids, self._fingerprints, self._arbiters = {}, {}, {}, {}
        self._judgement = None
        live = core.live()
        owners = [r for r in live if p.policy.work(r).contributes_first_pass
                  and p.policy.work(r).first_pass]
        self._checks = pairs(verify.seed, iteration, owners, live, verify.rate)
        self._check_ids = {owner: list(p.policy.work(owner).first_pass) for owner in self._checks}
        for owner, checker in self._checks.items():
            if checker == p.replica:
                self._fingerprints["check"] = {owner: self._run_for(core, iteration,
                                                                    self._check_ids[owner])}
                p.buffers.zero()
                p.optimizer.zero_grad()
                core.recovery.begin_iteration()

    def pass_mode(self, core, first):
        """A checked owner fingerprints its first pass's buckets as they go out (re-reductions
        send the same or other ids)."""
        checked = first and core.p.replica in self._checks
        return {"fingerprint": self.fingerprint.bucket} if checked else {}

    def first_pass_done(self, core):
        if core.p.replica in self._checks:  # every bucket went out: each fingerprinted
            self._fingerprints["own"] = {
                core.p.replica: sum_fingerprints(core.recovery.fingerprints)}

    def _run_for(self, core, iteration: int, ids: list[int]) -> torch.Tensor:
        """Run `ids` on empty buckets (`Round.run_for`) and fingerprint what they hold."""
        core.run_for(iteration, ids)
        return self.fingerprint.buckets(core.recovery.grads)

    def reran_own(self, core):
        if "own" in self._fingerprints:  # what it would now send
            self._fingerprints["own"] = {
                core.p.replica: self.fingerprint.buckets(core.recovery.grads)}

    def lane(self, core, iteration, sent):
        return self.slots.encode(self._fingerprints)

    def view(self, core, iteration, lane, totals, head):
        self._judgement = judge(self.slots.decode(lane), self._checks, core.live(),
                                self.verification.tolerance)
        vector = torch.zeros(self.verdict_size, dtype=torch.float64)
        for k, kind in enumerate(KINDS):
            replica_flags(vector, k * self.w_init, getattr(self._judgement, kind), self.w_init)
        return vector

    def _sets(self, verdict: torch.Tensor) -> dict[str, frozenset[int]]:
        return {kind: replica_set(verdict, k * self.w_init, self.w_init)
                for k, kind in enumerate(KINDS)}

    def asks(self, core, verdict):
        return HOLD if any(self._sets(verdict).values()) else COMMIT

    def act(self, core, iteration, verdict, events, detected):
        """Two replicas' fingerprints of the same ids differ. With an arbitration's result: the
        replicas to evict (this rank raises if its replica is one); before one: this
        iteration's arbiters rerun the suspects' ids (nothing to evict yet). Without a possible
        arbitration the job ends."""
        p, sets = core.p, self._sets(verdict)
        if sets["unresolved"]:
            owner = min(sets["unresolved"])
            third = self._arbiters.get(owner)
            why = (f"replica {third}, which ran them a third time, agrees with neither"
                   if third is not None else "no third live replica can tell which is right")
            raise UnresolvedCorruption(
                f"iteration {iteration}: replicas {owner} and {self._checks[owner]} computed "
                f"different gradients for microbatches {self._check_ids[owner]}, and {why}; "
                "nothing of the iteration is committed (kernels that are not deterministic "
                "need a measured --recover-sdc-tolerance)")
        if sets["evict"]:
            evicted = sorted(sets["evict"])
            events.append({"event": "corruption", "evicted": evicted, "detected": detected,
                           "owners": sorted(o for o, c in self._checks.items()
                                            if {o, c} & set(evicted))})
            if p.replica in sets["evict"]:
                raise SilentCorruption(
                    f"iteration {iteration}: this replica's gradient fingerprint differs from "
                    "what two other replicas computed for the same microbatches: its device is "
                    "taken for faulty and the replica leaves before the commit")
            return sorted(sets["evict"] - core.dead_replicas)
        live = core.live()
        suspects = sorted(sets["suspects"])
        for owner in suspects:
            self._arbiters[owner] = arbiter(owner, self._checks[owner], live)
        events.append({"event": "mismatch", "owners": suspects,
                       "checkers": [self._checks[o] for o in suspects],
                       "arbiters": [self._arbiters[o] for o in suspects],
                       "detected": detected})
        for owner in suspects:
            if self._arbiters[owner] == p.replica:
                self._fingerprints.setdefault("arbiter", {})[owner] = self._run_for(
                    core, iteration, self._check_ids[owner])
                core.recovery.rewind()  # back to what this replica reduced
        return []

    def committed(self, core, iteration, verdict, result, events, report):
        """Microbatches of the committed round whose owner's and checker's fingerprints
        agreed."""
        if self._judgement is not None:
            report.verified = sum(len(self._check_ids[owner])
                                  for owner in self._judgement.checked)
