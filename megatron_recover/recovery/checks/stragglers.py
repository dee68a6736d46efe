"""Straggler handling as a registered check: each replica's first-pass time per microbatch,
measured where it runs, agreed in the round, fed to the policy's commit (`policy.speed`).

A slow replica is not a failure: the next layout gives it fewer microbatches (B unchanged).
Past --recover-evict-slower-than for the window it is evicted at the commit, after its step
(fail-slow made fail-stop): its ranks leave as a failed replica's would, and the survivors'
next round sees them gone. The check never holds a round.
"""

from __future__ import annotations

import time

import torch

from megatron_recover.errors import Straggler
from megatron_recover.recovery.checks.base import Check


class SpeedSlots:
    """The replicas' first-pass compute time per microbatch in the commit lane: per replica id,
    the microseconds its ranks at this position measured (whole numbers, so the sum is exact in
    any order and equal on every rank) and how many of them measured (a distributed-optimizer
    shard that ran nothing does not). Decoded: replica -> seconds per microbatch, the mean over
    its measuring shards."""

    def __init__(self, w_init: int):
        self.w_init = w_init
        self.size = 2 * w_init

    def encode(self, replica: int, seconds: float | None) -> torch.Tensor:
        vector = torch.zeros(self.size, dtype=torch.float64)
        if seconds is not None:
            vector[replica] = float(max(1, round(seconds * 1e6)))
            vector[self.w_init + replica] = 1.0
        return vector

    def decode(self, vector: torch.Tensor) -> dict[int, float]:
        w = self.w_init
        return {r: float(vector[r]) / float(vector[w + r]) / 1e6 for r in range(w)
                if vector[w + r] > 0}


class Stragglers(Check):
    """The verdict segment holds each replica's seconds per microbatch, the slowest of its
    positions' (MAX)."""

    name = "stragglers"

    def __init__(self, w_init: int, straggler):
        self.w_init = w_init
        self.straggler = straggler  # the policy's straggler config
        self.slots = SpeedSlots(w_init)
        self.lane_size = self.slots.size
        self.verdict_size = w_init
        self._seconds: float | None = None  # this rank's, once read

    def begin(self, core, iteration):
        self._seconds = None

    def _seconds_per_microbatch(self, core) -> float | None:
        """This rank's first pass: seconds per microbatch (None: it ran none). Read once the
        pass's reductions completed: on CUDA its end event is then long done."""
        if self._seconds is None and core.first_pass is not None:
            timer, microbatches = core.first_pass
            self._seconds = timer.seconds() / microbatches
        return self._seconds

    def lane(self, core, iteration, sent):
        return self.slots.encode(core.p.replica, self._seconds_per_microbatch(core))

    def view(self, core, iteration, lane, totals, head):
        vector = torch.zeros(self.w_init, dtype=torch.float64)
        for replica, seconds in self.slots.decode(lane).items():
            vector[replica] = seconds
        return vector

    def speeds(self, verdict: torch.Tensor) -> dict[int, float]:
        return {r: float(verdict[r]) for r in range(self.w_init) if verdict[r] > 0}

    def commit_inputs(self, verdict):
        return {"times": self.speeds(verdict)}

    def committed(self, core, iteration, verdict, result, events, report):
        report.speeds = dict(sorted(self.speeds(verdict).items()))
        report.slow = sorted(result.slow)
        report.evicted = sorted(result.evicted)
        if not result.evicted:
            return
        # The next layout is without them; their ranks leave after this step.
        window = self.straggler.window
        evicted = sorted(result.evicted)
        events.append({"event": "straggler", "evicted": evicted,
                       "ratios": {str(r): round(result.ratios[r], 3) for r in evicted},
                       "window": window, "detected": time.time()})
        core.dead_replicas.update(evicted)
        if core.p.replica in result.evicted:
            raise Straggler(
                f"iteration {iteration}: this replica's first pass took "
                f"{result.ratios[core.p.replica]:.2f} times the other replicas' median per "
                f"microbatch, past --recover-evict-slower-than "
                f"{self.straggler.evict_slower_than:g} for {window} iterations: it leaves after "
                "this step as a failed replica would")
