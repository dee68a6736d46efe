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

from dataclasses import dataclass, field

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


class CommitLane:
    """Encodes and decodes the commit lane: [loss sum, tokens, exit request, ledger...], then,
    with sampled verification, the fingerprint slots (`verification.Slots`), then, with
    non-finite reruns, their flags (`rerun.RerunSlots`), then, with straggler handling, the
    replicas' times per microbatch (`SpeedSlots`), then, with a shared audit, its expected side
    (`ExpectedSlots`), then `side` values summed over the sent ledger's microbatches as the loss
    is (the MoE auxiliary losses, per name and layer)."""

    HEAD = 3

    def __init__(self, layout: LaneLayout, slots: Slots | None = None,
                 reruns: RerunSlots | None = None, speeds: SpeedSlots | None = None,
                 expected: ExpectedSlots | None = None, side: int = 0):
        self.layout = layout
        self.slots = slots
        self.reruns = reruns
        self.speeds = speeds
        self.expected = expected
        self._reruns_at = self.HEAD + layout.size + (0 if slots is None else slots.size)
        self._speeds_at = self._reruns_at + (0 if reruns is None else reruns.size)
        self._expected_at = self._speeds_at + (0 if speeds is None else speeds.size)
        self._side_at = self._expected_at + (0 if expected is None else expected.size)
        self.side = side
        self.size = self._side_at + side

    def encode(self, head: LaneHead, sent: Ledger | None, iteration: int,
               poison: int = 0, fingerprints: dict | None = None,
               reruns: RerunView | None = None,
               speed: tuple[int, float | None] | None = None,
               expected: dict[int, tuple[int, int]] | None = None,
               side: list[float] | None = None) -> torch.Tensor:
        """The lane vector of this rank; `sent` is None when its buckets sent nothing;
        `fingerprints` (kind -> replica id -> fingerprint) is what this rank computed, `reruns`
        what it found non-finite, `speed` (its replica, its first pass's seconds per microbatch
        or None) what it measured, `expected` its share of the audit's expected side (id ->
        (checksum, tokens)), `side` its side values (zeros when None)."""
        values = torch.tensor([head.loss_sum, head.tokens, float(head.exit_requested)],
                              dtype=torch.float64)
        parts = [values, self.layout.encode(sent, iteration, poison=poison)]
        if self.slots is not None:
            parts.append(self.slots.encode(fingerprints or {}))
        if self.reruns is not None:
            parts.append(self.reruns.encode(reruns or RerunView()))
        if self.speeds is not None:
            parts.append(self.speeds.encode(*(speed or (0, None))))
        if self.expected is not None:
            parts.append(self.expected.encode(expected or {}))
        if self.side:
            parts.append(torch.zeros(self.side, dtype=torch.float64) if side is None
                         else torch.tensor(side, dtype=torch.float64))
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
        return self.reruns.decode(lane[self._reruns_at:self._speeds_at])

    def decode_speeds(self, lane: torch.Tensor) -> dict[int, float]:
        """The summed lane's times per microbatch: replica -> seconds (empty without straggler
        handling)."""
        if self.speeds is None:
            return {}
        return self.speeds.decode(lane[self._speeds_at:self._expected_at])

    def decode_expected(self, lane: torch.Tensor) -> dict[int, tuple[int, int]] | None:
        """The summed lane's expected side: id -> (checksum, tokens), each from the one rank
        that computed it (None without a shared audit)."""
        if self.expected is None:
            return None
        return self.expected.decode(lane[self._expected_at:self._side_at])

    def decode_side(self, lane: torch.Tensor) -> list[float]:
        """The summed lane's side values (empty without side slots)."""
        return lane[self._side_at:].tolist()

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
    # Each replica's first-pass seconds per microbatch, the slowest of its positions' (with
    # straggler handling; empty otherwise).
    speeds: dict = field(default_factory=dict)

    @property
    def corrupt(self) -> bool:
        """Some position's fingerprints disagree: the round must not commit as it is."""
        return bool(self.suspects or self.evict or self.unresolved)


class VerdictCodec:
    """Encodes one position's view of a round so that the element-wise MAX over a replica's
    positions decodes to the replica's verdict: [dead flag per replica id 0..w_init-1, round
    failed, loss sum, ledger problem, tokens, exit request, then a flag per replica id for each
    of suspects, evict and unresolved, then the non-finite flags (`rerun.RerunSlots`), then, with
    straggler handling, each replica's seconds per microbatch (MAX: its slowest position)]."""

    def __init__(self, w_init: int, speeds: bool = False):
        self.w_init = w_init
        self._reruns = RerunSlots(w_init)
        self._speeds_at = 4 * w_init + 5 + self._reruns.size
        self.size = self._speeds_at + (w_init if speeds else 0)

    def _flags(self, vector: torch.Tensor, at: int, replicas) -> None:
        w = self.w_init
        for replica in replicas:
            if not 0 <= replica < w:
                raise ValueError(f"replica id {replica} outside 0..{w - 1}")
            vector[at + replica] = 1.0

    def _set(self, vector: torch.Tensor, at: int) -> frozenset[int]:
        return frozenset(r for r in range(self.w_init) if vector[at + r] > 0)

    def encode(self, dead: set[int], failed: bool, head: LaneHead, ledger_bad: bool,
               judgement=None, reruns: RerunView | None = None,
               speeds: dict[int, float] | None = None) -> torch.Tensor:
        """`judgement`: this position's `verification.Judgement`, if its fingerprints were
        judged; `reruns`: its summed lane's non-finite flags; `speeds`: its summed lane's times
        per microbatch."""
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
            vector[4 * w + 5:self._speeds_at] = self._reruns.encode(reruns)
        for replica, seconds in (speeds or {}).items():
            if self.size > self._speeds_at:
                vector[self._speeds_at + replica] = seconds
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
                       reruns=self._reruns.decode(vector[4 * w + 5:self._speeds_at]),
                       speeds={r: float(vector[self._speeds_at + r]) for r in range(w)
                               if self.size > self._speeds_at and vector[self._speeds_at + r] > 0})
