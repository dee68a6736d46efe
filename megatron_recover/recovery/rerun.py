"""Classifying a non-finite gradient by running its microbatches again, before the commit.

With `--recover-nonfinite-rerun evict|keep`, a replica whose first-pass bucket fails Megatron's
NaN/inf check does not leave at once: it holds its gradient out of the reduction (it sends zeros,
as a spare does) and says so in the commit lane. The round does not commit. Every replica then
learns the suspects, and two reruns of each suspect's first-pass microbatch ids, from empty
buffers, classify the fault as Megatron-LM's rerun state machine does (a rerun in place, then one
on another device), both at once:

  * the suspect reruns its own ids (in place);
  * its checker, the next live replica that is not a suspect, runs the same ids.

Their findings ride in the next round's lane, and every replica reaches the same outcome:

  suspect's rerun   checker's run   outcome
  finite            finite          TRANSIENT: not reproducible; keep the rerun's gradient
                                    (`keep`) or evict the replica (`evict`)
  non-finite        finite          PERSISTENT: the suspect's device is wrong: evict it
  non-finite        non-finite      DATA: the microbatches give NaN/inf anywhere: the job ends
                                    with their ids (a program error), nothing committed
  finite            non-finite      CHECKER: the checker's device is wrong: evict the checker,
                                    and the suspect's fault counts as transient
  non-finite        (no checker)    UNKNOWN: nobody can tell the data from the device: the job
                                    ends as for DATA

docs/failures.md says the same for users. This module is pure: the lane slots, the choice of
checkers and the table above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OFF, EVICT, KEEP = "off", "evict", "keep"  # --recover-nonfinite-rerun
MODES = (OFF, EVICT, KEEP)

TRANSIENT, PERSISTENT, DATA, CHECKER, UNKNOWN = (
    "transient", "persistent", "data", "checker", "unknown")


def checkers(suspects: list[int], live: list[int]) -> dict[int, int | None]:
    """Each suspect's checker: the next live replica after it (in id order, cyclic) that is not
    a suspect; failing that, any other live replica; None when it is the only one left."""
    ring = sorted(live)
    chosen = {}
    for suspect in sorted(suspects):
        start = ring.index(suspect) if suspect in ring else 0
        order = ring[start + 1:] + ring[:start + 1]
        others = [r for r in order if r != suspect]
        healthy = [r for r in others if r not in suspects]
        chosen[suspect] = (healthy or others or [None])[0]
    return chosen


def classify(own_bad: bool, checker: int | None, check_bad: bool) -> str:
    """The outcome of one suspect's two reruns (the table of the module's docstring)."""
    if checker is None:
        return UNKNOWN if own_bad else TRANSIENT
    if own_bad:
        return DATA if check_bad else PERSISTENT
    return CHECKER if check_bad else TRANSIENT


@dataclass(frozen=True)
class RerunView:
    """What a lane (or a replica's verdict) says: replicas whose first pass was held out as
    non-finite, and the reruns that found a non-finite gradient, by the suspect ran in place
    (`own_bad`) or by the suspect's checker (`check_bad`, keyed by the suspect)."""

    nonfinite: frozenset[int] = frozenset()
    own_bad: frozenset[int] = frozenset()
    check_bad: frozenset[int] = frozenset()


class RerunSlots:
    """Three flags per replica id in the commit lane: first pass held out as non-finite, own
    rerun non-finite, checker's run non-finite. Each is written only by the ranks of one
    replica at a position (distributed-optimizer shards add theirs up), so a summed flag is
    set exactly when some writer set it."""

    KINDS = ("nonfinite", "own_bad", "check_bad")

    def __init__(self, w_init: int):
        self.w_init = w_init
        self.size = len(self.KINDS) * w_init

    def encode(self, view: RerunView) -> torch.Tensor:
        vector = torch.zeros(self.size, dtype=torch.float64)
        for k, kind in enumerate(self.KINDS):
            for replica in getattr(view, kind):
                if not 0 <= replica < self.w_init:
                    raise ValueError(f"replica id {replica} outside 0..{self.w_init - 1}")
                vector[k * self.w_init + replica] = 1.0
        return vector

    def decode(self, vector: torch.Tensor) -> RerunView:
        w = self.w_init
        return RerunView(**{kind: frozenset(r for r in range(w) if vector[k * w + r] > 0)
                            for k, kind in enumerate(self.KINDS)})
