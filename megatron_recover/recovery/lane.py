"""The commit lane and the replica verdict: the two control vectors of a round, as codecs.

The commit lane is what one rank adds to the cross-replica sum after its bucket reductions: its
loss sum, its loss tokens, whether it asks to stop, then the ledger its buckets sent
(`ledger.LaneLayout`). Summed over the replicas (one ulfm all-reduce) it is the committed
iteration's ledger at this position. Every field sums meaningfully: float64 holds the integer
fields exactly below 2^53.

The replica verdict is what the ranks of one replica exchange after their positions' consensus
(a MAX all-reduce inside the replica): which replicas some position saw die, whether some
position's round failed, whether some position's ledger audit found a problem, the exit request,
and the loss sum and tokens. Each field is a flag (MAX is OR) or a value that only one position
holds non-zero (with pipeline stages, only the last stage sees losses; the others send 0, and
losses and token counts are never negative), so the MAX is the replica's value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_recover.recovery.ledger import LaneLayout, LaneTotals, Ledger


@dataclass(frozen=True)
class LaneHead:
    """The lane's fields before the ledger: sums over what this rank's buckets sent."""

    loss_sum: float  # the losses of the microbatches in the sent ledger (last pipeline stage)
    tokens: int  # their loss tokens (--calculate-per-token-loss)
    exit_requested: bool  # this rank asks to stop after the iteration (summed: some rank did)


class CommitLane:
    """Encodes and decodes the commit lane: [loss sum, tokens, exit request, ledger...]."""

    HEAD = 3

    def __init__(self, layout: LaneLayout):
        self.layout = layout
        self.size = self.HEAD + layout.size

    def encode(self, head: LaneHead, sent: Ledger | None, iteration: int,
               poison: int = 0) -> torch.Tensor:
        """The lane vector of this rank; `sent` is None when its buckets sent nothing."""
        values = torch.tensor([head.loss_sum, head.tokens, float(head.exit_requested)],
                              dtype=torch.float64)
        return torch.cat([values, self.layout.encode(sent, iteration, poison=poison)])

    def decode_head(self, lane: torch.Tensor) -> LaneHead:
        return LaneHead(loss_sum=float(lane[0]), tokens=int(round(float(lane[1]))),
                        exit_requested=bool(lane[2] > 0))

    def decode_ledger(self, lane: torch.Tensor) -> LaneTotals:
        return self.layout.decode(lane[self.HEAD:])

    def empty(self) -> torch.Tensor:
        """A lane that sent nothing and asks nothing (an evaluation round)."""
        return self.encode(LaneHead(0.0, 0, False), None, iteration=0)


@dataclass(frozen=True)
class Verdict:
    """A round's outcome for one replica: the same on all of its ranks."""

    dead: frozenset[int]  # replicas some position saw fail
    commit: bool  # no position saw a failure: the round commits
    loss_sum: float  # the replica's loss sum (the last pipeline stage's)
    tokens: int  # the loss tokens of the microbatches in the committed ledger
    invariant_ok: bool  # the ledger invariant held at every position
    exit_requested: bool  # some rank of some replica asked to stop after this iteration


class VerdictCodec:
    """Encodes one position's view of a round so that the element-wise MAX over a replica's
    positions decodes to the replica's verdict: [dead flag per replica id 0..w_init-1, round
    failed, loss sum, ledger problem, tokens, exit request]."""

    def __init__(self, w_init: int):
        self.w_init = w_init
        self.size = w_init + 5

    def encode(self, dead: set[int], failed: bool, head: LaneHead,
               ledger_bad: bool) -> torch.Tensor:
        w = self.w_init
        vector = torch.zeros(self.size, dtype=torch.float64)
        for replica in dead:
            if not 0 <= replica < w:
                raise ValueError(f"replica id {replica} outside 0..{w - 1}")
            vector[replica] = 1.0
        vector[w] = float(failed)
        vector[w + 1] = head.loss_sum
        vector[w + 2] = float(ledger_bad)
        vector[w + 3] = head.tokens
        vector[w + 4] = float(head.exit_requested)
        return vector

    def decode(self, vector: torch.Tensor) -> Verdict:
        w = self.w_init
        return Verdict(dead=frozenset(r for r in range(w) if vector[r] > 0),
                       commit=bool(vector[w] == 0), loss_sum=float(vector[w + 1]),
                       tokens=int(round(float(vector[w + 3]))),
                       invariant_ok=bool(vector[w + 2] == 0),
                       exit_requested=bool(vector[w + 4] > 0))
