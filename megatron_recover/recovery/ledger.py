"""The gradient ledger: which microbatch gradients a bucket holds, kept beside the bucket.

A `Ledger` is a multiset of `Entry(iteration, microbatch_id, checksum)`. An entry is registered
when the schedule consumes a microbatch (the batch names its own iteration and id, and the
checksum is computed from its tokens, labels and loss mask), not from the id list a pass was
asked to run. Layer 2 applies to a bucket's ledger exactly what it applies to the bucket's
gradient: a snapshot copies it, a rewind restores the copy, zeroing clears it, adding the snapshot
back merges the copy, a non-contributing reduce sends an empty ledger. Once a bucket was handed to
a cross-replica reduction its contents are no longer this rank's own gradient, so its ledger
becomes *unknown* until a rewind or a zero; reducing an unknown ledger poisons the iteration.

`LaneLayout` writes a ledger into the commit lane: a float64 vector that is summed across
replicas in the same all-reduce as the loss, so the committed iteration's ledger is the sum of the
replicas' sent ledgers. It holds a count per main-stream id 0..B-1, per reserve-stream slot a count
and a generation (enough to name each reserve id exactly when no slot holds two), the sum of the
checksums, and counts of foreign (other-iteration) entries and of poison. Every value is an
integer below 2^53, so sums are exact in float64.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

CHECKSUM_MODULUS = (1 << 31) - 1


class Entry(NamedTuple):
    iteration: int
    microbatch_id: int
    checksum: int  # < CHECKSUM_MODULUS


@dataclass
class Ledger:
    """The microbatch gradients a gradient buffer holds now (a multiset: an id run twice counts
    twice). `known` is False once the buffer holds something else: a cross-replica sum, or what a
    failed reduction left behind."""

    entries: Counter = field(default_factory=Counter)
    known: bool = True

    def register(self, entry: Entry) -> None:
        self.entries[entry] += 1

    def clear(self) -> None:
        self.entries.clear()
        self.known = True

    def copy(self) -> "Ledger":
        return Ledger(Counter(self.entries), self.known)

    def add(self, other: "Ledger") -> None:
        self.entries.update(other.entries)
        self.known = self.known and other.known

    def __eq__(self, other) -> bool:
        return (isinstance(other, Ledger) and self.known == other.known
                and +self.entries == +other.entries)

    def __len__(self) -> int:
        return sum(self.entries.values())


@dataclass(frozen=True)
class LaneTotals:
    """A decoded lane: what the replicas' buckets held, summed.

    main_counts[k]: how many times main-stream id k is held. reserve: the reserve ids held, when
    each slot held at most one (`reserve_clash` counts the slots that held more). checksum: the sum
    of the entries' checksums. foreign: entries of another iteration. poison: buckets reduced with
    an unknown ledger, or a rank whose buckets' ledgers disagreed."""

    main_counts: tuple[int, ...]
    reserve: tuple[int, ...]
    reserve_clash: int
    checksum: int
    foreign: int
    poison: int

    @property
    def count(self) -> int:
        """Microbatch gradients held, each registration counted."""
        return sum(self.main_counts) + len(self.reserve) + self.reserve_clash + self.foreign

    @property
    def main_ids(self) -> tuple[int, ...]:
        """Main-stream ids held at least once."""
        return tuple(k for k, n in enumerate(self.main_counts) if n)


class LaneLayout:
    """Where a ledger sits in the commit lane; see the module docstring.

    b: the main-stream ids of an iteration are 0..b-1. reserve: whether reserve ids (>= b) can
    occur (reserve mode); they are kept modulo 2b, which names them exactly as long as one
    iteration's reserve ids span fewer than 2b positions of the reserve stream.
    """

    def __init__(self, b: int, reserve: bool):
        self.b = b
        self.slots = 2 * b if reserve else 0
        self.size = b + 2 * self.slots + 3

    def encode(self, ledger: Ledger | None, iteration: int, poison: int = 0) -> torch.Tensor:
        """The lane vector of `ledger` (None: nothing was sent) for `iteration`."""
        lane = torch.zeros(self.size, dtype=torch.float64)
        b, slots = self.b, self.slots
        lane[-1] = poison
        if ledger is None:
            return lane
        if not ledger.known:
            lane[-1] += 1
        for (t, k, checksum), n in ledger.entries.items():
            if n <= 0:
                continue
            lane[-3] += n * checksum
            if t != iteration or k < 0 or (k >= b and not slots):
                lane[-2] += n
            elif k < b:
                lane[k] += n
            else:
                slot, generation = divmod(k - b, slots)[::-1]
                lane[b + slot] += n
                lane[b + slots + slot] += n * (generation + 1)
        return lane

    def decode(self, lane: torch.Tensor) -> LaneTotals:
        values = [int(round(x)) for x in lane.tolist()]
        b, slots = self.b, self.slots
        reserve, clash = [], 0
        for slot in range(slots):
            n, generation = values[b + slot], values[b + slots + slot]
            if n == 1:
                reserve.append(b + (generation - 1) * slots + slot)
            elif n > 1:
                clash += n
        return LaneTotals(main_counts=tuple(values[:b]), reserve=tuple(sorted(reserve)),
                          reserve_clash=clash, checksum=values[-3], foreign=values[-2],
                          poison=values[-1])
