"""What a registered check is: its segments of the round's two vectors, what it judges, the
action it asks for.

A round (`round.Round`) runs a first pass, posts every bucket's reduction, sums the commit lane
and agrees on a verdict. Every registered check rides in that round:

  * `lane` is its segment of this rank's commit lane (summed over the replicas, `lane_size`
    float64 values; None sends zeros);
  * `view` is its segment of this position's replica verdict (MAX over the replica's positions,
    `verdict_size` values), from the summed lane's segment; it is asked only when the
    position's round succeeded everywhere (otherwise the segment is zeros);
  * `asks` says, from the replica's verdict segment, whether the round may commit (COMMIT) or
    the check must act first (HOLD); it has no side effects. A failure of a replica is stronger
    than any check: the core handles it and tells every check (`on_failure`). Among checks
    asking HOLD the first registered acts (`act`): it runs what it needs (reruns, an
    arbitration) and returns the replicas to evict as failed ones, or none, and then the core
    reduces the same contributions again (a blocking restore) and asks again;
  * the remaining hooks (`begin`, `pass_mode`, `first_pass_done`, `holds_own`, `reran_own`,
    `commit_inputs`, `committed`) let a check prepare an iteration, say whether this replica's
    contribution is held out, feed the policy's commit and fill its fields of the step report.

Every input of `asks` and `act` is agreed (the verdict, the policy's layout), so every survivor
takes the same branch. A new check is a new module here and one line in `registered`.
"""

from __future__ import annotations

import torch

COMMIT, HOLD = 0, 1


class Check:
    """The protocol of a registered check; the defaults do nothing."""

    name = ""
    lane_size = 0  # float64 values in the commit lane
    verdict_size = 0  # float64 values in the replica verdict
    cause = ""  # a failure event's cause when `act` evicts replicas

    def begin(self, core, iteration: int) -> None:
        """Before the iteration's first pass (buffers empty)."""

    def first_pass_done(self, core) -> None:
        """The first pass ran and every bucket's reduction was posted."""

    def lane(self, core, iteration: int, sent) -> torch.Tensor | None:
        """This rank's lane segment (`sent`: the ledger its buckets sent, or None)."""
        return None

    def view(self, core, iteration: int, lane: torch.Tensor, totals, head) -> torch.Tensor | None:
        """This position's verdict segment from the summed lane's segment, the committed
        ledger's `totals` and the summed lane's `head` (asked only when the position's round
        succeeded everywhere)."""
        return None

    def asks(self, core, verdict: torch.Tensor) -> int:
        """COMMIT or HOLD, from the replica's verdict segment; no side effects."""
        return COMMIT

    def act(self, core, iteration: int, verdict: torch.Tensor, events: list[dict],
            detected: float) -> list[int]:
        """(The check asked HOLD and acts.) The replicas to evict as failed ones, or none:
        the core then reduces the same contributions again. May raise to end this rank."""
        return []

    def on_failure(self, core, iteration: int, new_dead: list[int]) -> list[int]:
        """Replicas died in this round: the replicas to treat as dead (`new_dead`, or more)."""
        return new_dead

    def pass_mode(self, core, first: bool) -> dict:
        """Fields of the next round of reductions' `gradients.PassMode` (`first`: the
        iteration's first pass)."""
        return {}

    def reran_own(self, core) -> None:
        """This replica's buckets now hold a rerun of its own first pass (another check ran
        it): what it would send from now on."""

    def holds_own(self, core) -> bool:
        """Whether this replica's contribution stays out of the next reduction."""
        return False

    def commit_inputs(self, verdict: torch.Tensor) -> dict:
        """Keyword arguments of the policy's commit (`WorkloadPolicy.commit`)."""
        return {}

    def committed(self, core, iteration: int, verdict: torch.Tensor, result, events: list[dict],
                  report) -> None:
        """The round committed (the optimizer stepped): fill this check's report fields."""
