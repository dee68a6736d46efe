"""Sets of microbatch ids, stored as sorted half-open intervals.

A layout hands out contiguous id ranges, and failures only ever move whole ranges around, so an
iteration's assignment stays a handful of intervals even when B is 8,192. Every operation here is
linear in the number of intervals, never in the number of ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator


def _normalize(spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sort `spans`, drop empty ones and merge overlapping or touching ones."""
    merged: list[list[int]] = []
    for lo, hi in sorted(s for s in spans if s[0] < s[1]):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


@dataclass(frozen=True)
class IdSet:
    """An immutable set of non-negative integer ids.

    `spans` is the canonical form: sorted, non-empty, pairwise non-touching [lo, hi) intervals, so
    two IdSets are equal exactly when they hold the same ids. Build one with `IdSet.range`,
    `IdSet.of` or `IdSet.union_all`; the constructor only accepts canonical spans.
    """

    spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        assert _normalize(self.spans) == self.spans, f"non-canonical spans {self.spans}"
        assert not self.spans or self.spans[0][0] >= 0, "ids are non-negative"

    @classmethod
    def range(cls, lo: int, hi: int) -> IdSet:
        """The ids lo, lo+1, ..., hi-1 (empty when hi <= lo)."""
        return cls(_normalize([(lo, hi)]))

    @classmethod
    def of(cls, ids: Iterable[int]) -> IdSet:
        """The set of the given ids (duplicates collapse)."""
        return cls(_normalize((i, i + 1) for i in ids))

    @classmethod
    def union_all(cls, sets: Iterable[IdSet]) -> IdSet:
        """The union of `sets`."""
        return cls(_normalize(span for s in sets for span in s.spans))

    def __len__(self) -> int:
        return sum(hi - lo for lo, hi in self.spans)

    def __bool__(self) -> bool:
        return bool(self.spans)

    def __iter__(self) -> Iterator[int]:
        for lo, hi in self.spans:
            yield from range(lo, hi)

    def __contains__(self, item: int) -> bool:
        return any(lo <= item < hi for lo, hi in self.spans)

    def __or__(self, other: IdSet) -> IdSet:
        return IdSet(_normalize(self.spans + other.spans))

    def first(self) -> int:
        """The smallest id; the set must not be empty."""
        if not self.spans:
            raise ValueError("first() of an empty IdSet")
        return self.spans[0][0]

    def take(self, n: int) -> tuple[IdSet, IdSet]:
        """Split into (the n smallest ids, the rest); n must not exceed len(self)."""
        if not 0 <= n <= len(self):
            raise ValueError(f"cannot take {n} ids from a set of {len(self)}")
        head: list[tuple[int, int]] = []
        tail: list[tuple[int, int]] = []
        for lo, hi in self.spans:
            if n >= hi - lo:
                head.append((lo, hi))
                n -= hi - lo
            elif n > 0:
                head.append((lo, lo + n))
                tail.append((lo + n, hi))
                n = 0
            else:
                tail.append((lo, hi))
        return IdSet(tuple(head)), IdSet(tuple(tail))

    def issubset(self, other: IdSet) -> bool:
        """True when every id of self is in other."""
        return IdSet(_normalize(self.spans + other.spans)) == other

    def isdisjoint(self, other: IdSet) -> bool:
        """True when self and other share no id."""
        return len(self | other) == len(self) + len(other)

    def to_list(self) -> list[int]:
        """The ids in increasing order (for JSON and tests; O(len))."""
        return list(iter(self))

    def __repr__(self) -> str:
        return "IdSet[" + ", ".join(f"{lo}:{hi}" for lo, hi in self.spans) + "]"
