"""Layer 2: in-step recovery of gradient reductions (snapshots, stale buckets, rewind)."""

from megatron_recover.recovery.gradients import GradientRecovery

__all__ = ["GradientRecovery"]
