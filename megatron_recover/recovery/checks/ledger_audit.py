"""The ledger audit as a registered check: the committed ledger against the failure-free
iteration, never against the policy's plan.

Its lane segment is the audit's expected side, computed in shares (`ExpectedSlots`): each
contributor to the lane fills 1/count of the ids, so the sum holds every id's checksum and
tokens from the one rank that computed it. Its verdict segment is one flag: some position's
audit found a problem. The audit reports; it never holds a round (a violation is evidence for
the run's record, and the tests fail on it).
"""

from __future__ import annotations

import torch

from megatron_recover.recovery.checks.base import Check


class ExpectedSlots:
    """The ledger audit's expected side, computed in shares: for each main id k < b, how many
    ranks computed it, its dataset checksum and its loss tokens. Each contributor to the lane
    fills the ids of its share (`Audit.share`); summed, every id's values come from the one
    rank that computed them (a count other than 1 leaves the id out: the audit says so)."""

    def __init__(self, b: int):
        self.b = b
        self.size = 3 * b

    def encode(self, expected: dict[int, tuple[int, int]]) -> torch.Tensor:
        vector = torch.zeros(self.size, dtype=torch.float64)
        if expected:
            vector.view(self.b, 3)[list(expected)] = torch.tensor(
                [(1.0, float(checksum), float(tokens)) for checksum, tokens in expected.values()],
                dtype=torch.float64)
        return vector

    def decode(self, vector: torch.Tensor) -> dict[int, tuple[int, int]]:
        rows = vector.view(self.b, 3).tolist()
        return {k: (int(checksum), int(tokens)) for k, (count, checksum, tokens)
                in enumerate(rows) if count == 1}


class LedgerAudit(Check):
    """`audit` (`interfaces.Audit`) judges each committed ledger at this position."""

    name = "ledger-audit"
    verdict_size = 1
    cause = "ledger"

    def __init__(self, audit, b: int, per_token_loss: bool, computes_loss: bool):
        self.audit = audit
        self.expected = ExpectedSlots(b)
        self.lane_size = self.expected.size
        # Only the last pipeline stage sees the loss tokens.
        self.counts_tokens = per_token_loss and computes_loss
        self.problems: list[str] = []
        self.totals = None

    def lane(self, core, iteration, sent):
        return self.expected.encode(self.audit.share(iteration, *core.audit_share()))

    def view(self, core, iteration, lane, totals, head):
        self.totals = totals
        self.problems = self.audit.problems(iteration, totals, core.divisor(),
                                            head.tokens if self.counts_tokens else None,
                                            self.expected.decode(lane))
        return torch.tensor([float(bool(self.problems))], dtype=torch.float64)

    def committed(self, core, iteration, verdict, result, events, report):
        self.audit.committed(self.totals)
        report.invariant_ok = bool(verdict[0] == 0)
        report.ledger_problems = self.problems
