"""The round's registered checks (`base.Check`), in their order of precedence.

  nonfinite-reruns  a first pass that fails the NaN/inf check, classified by reruns
  sdc               sampled cross-replica verification of first passes
  ledger-audit      the committed ledger against the failure-free iteration
  stragglers        first-pass speeds for the policy; eviction past the threshold
  side-sums         values summed like the loss (the MoE auxiliary losses)

The non-finite check comes before verification: a held-out first pass makes its owner's
fingerprint meaningless until the reruns classified it.
"""

from __future__ import annotations

from megatron_recover.recovery.checks.base import COMMIT, HOLD, Check
from megatron_recover.recovery.checks.ledger_audit import LedgerAudit
from megatron_recover.recovery.checks.nonfinite import NonfiniteReruns
from megatron_recover.recovery.checks.sdc import SampledVerification
from megatron_recover.recovery.checks.side_sums import SideSums
from megatron_recover.recovery.checks.stragglers import Stragglers
from megatron_recover.recovery.rerun import OFF


def registered(parts) -> list[Check]:
    """The checks a run with `parts` (`trainer.TrainerParts`) registers, in precedence order."""
    config = parts.policy.config
    checks: list[Check] = []
    if parts.nonfinite_rerun != OFF:
        checks.append(NonfiniteReruns(config.w_init, parts.nonfinite_rerun, parts.samples_of))
    if parts.verification is not None:
        checks.append(SampledVerification(config.w_init, parts.verification))
    checks.append(LedgerAudit(parts.audit, config.b, parts.per_token_loss, parts.computes_loss))
    if config.straggler.enabled:
        checks.append(Stragglers(config.w_init, config.straggler))
    if parts.side_size:
        checks.append(SideSums(parts.side_size, parts.side_sums))
    return checks


__all__ = ["COMMIT", "HOLD", "Check", "LedgerAudit", "NonfiniteReruns", "SampledVerification",
           "SideSums", "Stragglers", "registered"]
