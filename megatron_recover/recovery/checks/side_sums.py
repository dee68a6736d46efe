"""Side values summed like the loss, as a registered check (the MoE auxiliary losses).

Each microbatch's side values (per name and layer) ride in the commit lane, summed over the
microbatches of the sent ledger as the loss is, so the committed values are those of the
committed microbatches exactly; after the commit they are summed over the replica's positions
(TP pieces and pipeline stages). The check never holds a round.
"""

from __future__ import annotations

import torch

from megatron_recover.recovery.checks.base import Check


class SideSums(Check):
    """`side_sums(iteration, id -> count)` gives this rank's `size` values for its sent
    ledger's microbatches."""

    name = "side-sums"

    def __init__(self, size: int, side_sums):
        self.lane_size = size
        self.side_sums = side_sums
        self.summed: list[float] = []

    def lane(self, core, iteration, sent):
        if sent is None:
            return None
        counts: dict[int, int] = {}
        for (_, k, _), n in sent.entries.items():
            counts[k] = counts.get(k, 0) + n
        return torch.tensor(self.side_sums(iteration, counts), dtype=torch.float64)

    def view(self, core, iteration, lane, totals, head):
        self.summed = lane.tolist()
        return None

    def committed(self, core, iteration, verdict, result, events, report):
        """The committed sums of this position, summed over the replica's positions (the
        shards' lanes were summed already: shard 0 counts)."""
        vector = torch.tensor(self.summed, dtype=torch.float64) * float(core.shard == 0)
        if core.p.replica_control is not None:
            core.p.replica_control.sum(vector)  # a dead peer raises: the rank leaves
        report.side_sums = vector.tolist()
