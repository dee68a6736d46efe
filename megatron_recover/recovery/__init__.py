"""Layer 2: in-step recovery of gradient reductions (snapshots, stale buckets, rewind) and the
gradient ledger that records which microbatch gradients every bucket holds."""

from megatron_recover.recovery.gradients import GradientRecovery
from megatron_recover.recovery.ledger import Entry, LaneLayout, LaneTotals, Ledger

__all__ = ["Entry", "GradientRecovery", "LaneLayout", "LaneTotals", "Ledger"]
