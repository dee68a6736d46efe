"""The commit lane and the replica verdict: the two control vectors of a round, as codecs.

The commit lane is what one rank adds to the cross-replica sum after its bucket reductions: its
loss sum, its loss tokens, whether it asks to stop, then the ledger its buckets sent
(`ledger.LaneLayout`). Summed over the replicas (one ulfm all-reduce) it is the committed
iteration's ledger at this position. Every field sums meaningfully: float64 holds the integer
fields exactly below 2^53.

The replica verdict is what the ranks of one replica exchange after their positions' consensus
(a MAX all-reduce inside the replica): which replicas some position saw die, whether some
position's round failed, whether some position's ledger audit found a problem, the exit request,
the loss sum and tokens, and what the position's fingerprints say (`verification.judge`: owners
to arbitrate, replicas to evict, owners nobody can arbitrate). Each field is a flag (MAX is OR) or a value that only one position
holds non-zero (with pipeline stages, only the last stage sees losses; the others send 0, and
losses and token counts are never negative), so the MAX is the replica's value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_recover.recovery.ledger import LaneLayout, LaneTotals, Ledger
from megatron_recover.recovery.rerun import RerunSlots, RerunView
from megatron_recover.recovery.verification import Slots


@dataclass(frozen=True)
class LaneHead:
    """The lane's fields before the ledger: sums over what this rank's buckets sent."""

    loss_sum: float  # the losses of the microbatches in the sent ledger (last pipeline stage)
    tokens: int  # their loss tokens (--calculate-per-token-loss)
    exit_requested: bool  # this rank asks to stop after the iteration (summed: some rank did)


class CommitLane:
    """Encodes and decodes the commit lane: [loss sum, tokens, exit request, ledger...], then,
    with sampled verification, the fingerprint slots (`verification.Slots`), then, with
    non-finite reruns, their flags (`rerun.RerunSlots`)."""

    HEAD = 3

    def __init__(self, layout: LaneLayout, slots: Slots | None = None,
                 reruns: RerunSlots | None = None):
        self.layout = layout
        self.slots = slots
        self.reruns = reruns
        self._reruns_at = self.HEAD + layout.size + (0 if slots is None else slots.size)
        self.size = self._reruns_at + (0 if reruns is None else reruns.size)

    def encode(self, head: LaneHead, sent: Ledger | None, iteration: int,
               poison: int = 0, fingerprints: dict | None = None,
               reruns: RerunView | None = None) -> torch.Tensor:
        """The lane vector of this rank; `sent` is None when its buckets sent nothing;
        `fingerprints` (kind -> replica id -> fingerprint) is what this rank computed, `reruns`
        what it found non-finite."""
        values = torch.tensor([head.loss_sum, head.tokens, float(head.exit_requested)],
                              dtype=torch.float64)
        parts = [values, self.layout.encode(sent, iteration, poison=poison)]
        if self.slots is not None:
            parts.append(self.slots.encode(fingerprints or {}))
        if self.reruns is not None:
            parts.append(self.reruns.encode(reruns or RerunView()))
        return torch.cat(parts)

    def decode_head(self, lane: torch.Tensor) -> LaneHead:
        return LaneHead(loss_sum=float(lane[0]), tokens=int(round(float(lane[1]))),
                        exit_requested=bool(lane[2] > 0))

    def decode_ledger(self, lane: torch.Tensor) -> LaneTotals:
        return self.layout.decode(lane[self.HEAD:self.HEAD + self.layout.size])

    def decode_fingerprints(self, lane: torch.Tensor) -> dict:
        """The summed lane's fingerprints: kind -> replica id -> fingerprint."""
        return self.slots.decode(lane[self.HEAD + self.layout.size:self._reruns_at])

    def decode_reruns(self, lane: torch.Tensor) -> RerunView:
        """The summed lane's non-finite flags (empty without non-finite reruns)."""
        if self.reruns is None:
            return RerunView()
        return self.reruns.decode(lane[self._reruns_at:])

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
    suspects: frozenset[int] = frozenset()  # owners whose fingerprints differ: to arbitrate
    evict: frozenset[int] = frozenset()  # replicas whose fingerprint the other two contradict
    unresolved: frozenset[int] = frozenset()  # owners whose mismatch nobody can arbitrate
    reruns: RerunView = RerunView()  # non-finite first passes and reruns (`rerun.py`)

    @property
    def corrupt(self) -> bool:
        """Some position's fingerprints disagree: the round must not commit as it is."""
        return bool(self.suspects or self.evict or self.unresolved)


class VerdictCodec:
    """Encodes one position's view of a round so that the element-wise MAX over a replica's
    positions decodes to the replica's verdict: [dead flag per replica id 0..w_init-1, round
    failed, loss sum, ledger problem, tokens, exit request, then a flag per replica id for each
    of suspects, evict and unresolved, then the non-finite flags (`rerun.RerunSlots`)]."""

    def __init__(self, w_init: int):
        self.w_init = w_init
        self._reruns = RerunSlots(w_init)
        self.size = 4 * w_init + 5 + self._reruns.size

    def _flags(self, vector: torch.Tensor, at: int, replicas) -> None:
        w = self.w_init
        for replica in replicas:
            if not 0 <= replica < w:
                raise ValueError(f"replica id {replica} outside 0..{w - 1}")
            vector[at + replica] = 1.0

    def _set(self, vector: torch.Tensor, at: int) -> frozenset[int]:
        return frozenset(r for r in range(self.w_init) if vector[at + r] > 0)

    def encode(self, dead: set[int], failed: bool, head: LaneHead, ledger_bad: bool,
               judgement=None, reruns: RerunView | None = None) -> torch.Tensor:
        """`judgement`: this position's `verification.Judgement`, if its fingerprints were
        judged; `reruns`: its summed lane's non-finite flags."""
        w = self.w_init
        vector = torch.zeros(self.size, dtype=torch.float64)
        self._flags(vector, 0, dead)
        vector[w] = float(failed)
        vector[w + 1] = head.loss_sum
        vector[w + 2] = float(ledger_bad)
        vector[w + 3] = head.tokens
        vector[w + 4] = float(head.exit_requested)
        if judgement is not None:
            self._flags(vector, w + 5, judgement.suspects)
            self._flags(vector, 2 * w + 5, judgement.evict)
            self._flags(vector, 3 * w + 5, judgement.unresolved)
        if reruns is not None:
            vector[4 * w + 5:] = self._reruns.encode(reruns)
        return vector

    def decode(self, vector: torch.Tensor) -> Verdict:
        w = self.w_init
        return Verdict(dead=self._set(vector, 0),
                       commit=bool(vector[w] == 0), loss_sum=float(vector[w + 1]),
                       tokens=int(round(float(vector[w + 3]))),
                       invariant_ok=bool(vector[w + 2] == 0),
                       exit_requested=bool(vector[w + 4] > 0),
                       suspects=self._set(vector, w + 5), evict=self._set(vector, 2 * w + 5),
                       unresolved=self._set(vector, 3 * w + 5),
                       reruns=self._reruns.decode(vector[4 * w + 5:]))
