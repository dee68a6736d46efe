"""The commit lane and the replica verdict: the two control vectors of a round, as codecs.

The commit lane is what one rank adds to the cross-replica sum after its bucket reductions: its
loss sum, its loss tokens, whether it asks to stop, the ledger its buckets sent
(`ledger.LaneLayout`), then one segment per registered check (`checks/`), in registration
order. Summed over the replicas (one ulfm all-reduce) it is the committed iteration's ledger at
this position, and each check's segment is what the check's writers put there. Every field sums
meaningfully: float64 holds the integer fields exactly below 2^53.

The replica verdict is what the ranks of one replica exchange after their positions' consensus
(a MAX all-reduce inside the replica): which replicas some position saw die, whether some
position's round failed, the loss sum and tokens, the exit request, then one segment per
registered check. Each field is a flag (MAX is OR) or a value that only one position holds
non-zero (with pipeline stages, only the last stage sees losses; the others send 0, and losses
and token counts are never negative), so the MAX is the replica's value. A check's verdict
segment follows the same rule.

Both layouts are computed from the registered checks' sizes (`Segments`): no offset is kept by
hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_recover.recovery.ledger import LaneLayout, LaneTotals, Ledger


@dataclass(frozen=True)
class LaneHead:
    """The lane's fields before the ledger: sums over what this rank's buckets sent."""

    loss_sum: float  # the losses of the microbatches in the sent ledger (last pipeline stage)
    tokens: int  # their loss tokens (--calculate-per-token-loss)
    exit_requested: bool  # this rank asks to stop after the iteration (summed: some rank did)


class Segments:
    """Named consecutive slices of a vector from `start` on, in the order given: (name, size)
    pairs. `end` is where the last one ends."""

    def __init__(self, start: int, sizes: list[tuple[str, int]]):
        self.at: dict[str, tuple[int, int]] = {}
        for name, size in sizes:
            if name in self.at:
                raise ValueError(f"two segments named {name!r}")
            self.at[name] = (start, start + size)
            start += size
        self.end = start

    def join(self, parts: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The segments' values in order: `parts[name]`, or zeros where a name has none or
        None (a check that sends nothing). A value for a name no segment has is refused."""
        stray = {name for name, part in parts.items() if part is not None} - set(self.at)
        if stray:
            raise ValueError(f"no segment named {sorted(stray)}")
        out = []
        for name, (begin, end) in self.at.items():
            part = parts.get(name)
            if part is None:
                part = torch.zeros(end - begin, dtype=torch.float64)
            elif part.numel() != end - begin:
                raise ValueError(f"segment {name!r} holds {end - begin} values, got "
                                 f"{part.numel()}")
            out.append(part.to(torch.float64).view(-1))
        return out

    def split(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: vector[begin:end].clone() for name, (begin, end) in self.at.items()}


def replica_flags(vector: torch.Tensor, at: int, replicas, w_init: int) -> None:
    """Set the flag of each replica id of `replicas` in the `w_init` flags from `at` on."""
    for replica in replicas:
        if not 0 <= replica < w_init:
            raise ValueError(f"replica id {replica} outside 0..{w_init - 1}")
        vector[at + replica] = 1.0


def replica_set(vector: torch.Tensor, at: int, w_init: int) -> frozenset[int]:
    """The replica ids whose flag is set in the `w_init` flags from `at` on."""
    return frozenset(r for r in range(w_init) if vector[at + r] > 0)


class CommitLane:
    """Encodes and decodes the commit lane: [loss sum, tokens, exit request, ledger...], then
    each registered check's segment (`segments`: (name, size) pairs, in order)."""

    HEAD = 3

    def __init__(self, layout: LaneLayout, segments: list[tuple[str, int]] = ()):
        self.layout = layout
        self.segments = Segments(self.HEAD + layout.size, list(segments))
        self.size = self.segments.end

    def encode(self, head: LaneHead, sent: Ledger | None, iteration: int, poison: int = 0,
               parts: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The lane vector of this rank; `sent` is None when its buckets sent nothing; `parts`
        holds each check's segment by name (zeros for a check that sends none)."""
        values = torch.tensor([head.loss_sum, head.tokens, float(head.exit_requested)],
                              dtype=torch.float64)
        return torch.cat([values, self.layout.encode(sent, iteration, poison=poison),
                          *self.segments.join(parts or {})])

    def decode_head(self, lane: torch.Tensor) -> LaneHead:
        return LaneHead(loss_sum=float(lane[0]), tokens=int(round(float(lane[1]))),
                        exit_requested=bool(lane[2] > 0))

    def decode_ledger(self, lane: torch.Tensor) -> LaneTotals:
        return self.layout.decode(lane[self.HEAD:self.HEAD + self.layout.size])

    def decode_parts(self, lane: torch.Tensor) -> dict[str, torch.Tensor]:
        """The summed lane's check segments, by name."""
        return self.segments.split(lane)

    def empty(self) -> torch.Tensor:
        """A lane that sent nothing and asks nothing (an evaluation round)."""
        return self.encode(LaneHead(0.0, 0, False), None, iteration=0)


@dataclass(frozen=True)
class Verdict:
    """A round's outcome for one replica: the same on all of its ranks."""

    dead: frozenset[int]  # replicas some position saw fail
    commit: bool  # no position saw a failure: the round may commit (the checks have their say)
    loss_sum: float  # the replica's loss sum (the last pipeline stage's)
    tokens: int  # the loss tokens of the microbatches in the committed ledger
    exit_requested: bool  # some rank of some replica asked to stop after this iteration
    parts: dict = field(default_factory=dict)  # each check's verdict segment, by name


class VerdictCodec:
    """Encodes one position's view of a round so that the element-wise MAX over a replica's
    positions decodes to the replica's verdict: [dead flag per replica id 0..w_init-1, round
    failed, loss sum, tokens, exit request], then each registered check's segment."""

    def __init__(self, w_init: int, segments: list[tuple[str, int]] = ()):
        self.w_init = w_init
        self.segments = Segments(w_init + 4, list(segments))
        self.size = self.segments.end

    def encode(self, dead: set[int], failed: bool, head: LaneHead,
               parts: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """`parts`: this position's segment of each check (zeros where none)."""
        w = self.w_init
        vector = torch.zeros(w + 4, dtype=torch.float64)
        replica_flags(vector, 0, dead, w)
        vector[w] = float(failed)
        vector[w + 1] = head.loss_sum
        vector[w + 2] = head.tokens
        vector[w + 3] = float(head.exit_requested)
        return torch.cat([vector, *self.segments.join(parts or {})])

    def decode(self, vector: torch.Tensor) -> Verdict:
        w = self.w_init
        return Verdict(dead=replica_set(vector, 0, w),
                       commit=bool(vector[w] == 0), loss_sum=float(vector[w + 1]),
                       tokens=int(round(float(vector[w + 2]))),
                       exit_requested=bool(vector[w + 3] > 0),
                       parts=self.segments.split(vector))
