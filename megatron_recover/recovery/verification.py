"""Sampled cross-replica verification: a silently corrupted gradient is caught before the commit.

In exact mode a microbatch's gradient is a function of its id and of the parameters, which are
equal on every replica (`gpt.seed_microbatch` draws its dropout from the id), so two replicas
that run the same ids from empty buffers hold the same bits. Each iteration a deterministic
sample of the contributing replicas' first passes is run twice (`pairs`): by its owner, as
always, and by a checker, the next live replica, before the checker's own first pass and on
empty buffers (`recovery.zero()` clears the check pass's gradient and ledger before the own
pass starts, so the own pass, and the trajectory, is the one without checks, bit for bit).
Both fingerprint what they hold: the owner each bucket as it hands it to its cross-replica
reduction, the checker each bucket once its pass returned. A fingerprint is a fixed random
projection of the bucket (`Fingerprint`), linear and cheap (one read of the bucket), which any
flipped bit of the bucket changes. The fingerprints ride in the commit lane (`Slots`), so every
replica sees every fingerprint of its position.

A mismatch (`judge`) is arbitrated by a third live replica, which runs the owner's ids once
more from empty buffers and rewinds; its fingerprint comes in the next round's lane, and the
replica that disagrees with the other two is evicted as a failed one before anything is
committed: the survivors redo its microbatches in-step. With no third replica, or three
different fingerprints, the iteration is not committed and the job stops (`unresolved`).

Sampling is by replica, not by microbatch: a replica's whole first pass is checked or not, with
probability `rate` per iteration, so a corrupt gradient of any of its microbatches is caught with
that probability, at about `rate` of the job's compute, and a checker runs at most one extra
pass (`pairs` is a cycle over the live replicas).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

WIDTH = 2  # projections per fingerprint
_TILE = 1 << 16  # the projection's weights repeat every _TILE elements of a bucket
_ROWS = 256  # rows of _TILE elements projected at a time (bounds the float64 copy)


@dataclass(frozen=True)
class Verification:
    """--recover-sdc-check-rate and --recover-sdc-tolerance, with the run's --seed."""

    rate: float  # the probability that a contributing replica's first pass is checked
    seed: int  # the sample's and the projection's seed
    tolerance: float = 0.0  # 0: fingerprints must be equal bitwise


def sampled(seed: int, iteration: int, replica: int, rate: float) -> bool:
    """Whether `replica`'s first pass of `iteration` is checked: a hash of the three, below
    `rate` (the same on every rank, whatever the process)."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hashlib.blake2b(f"{seed}:{iteration}:{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64 < rate


def _next(live: list[int], after: int, excluded: set[int]) -> int | None:
    """The first replica of sorted `live` after `after`, cyclically, not in `excluded`."""
    order = [r for r in live if r > after] + [r for r in live if r <= after]
    return next((r for r in order if r not in excluded), None)


def pairs(seed: int, iteration: int, owners: list[int], live: list[int],
          rate: float) -> dict[int, int]:
    """owner -> checker for the sampled `owners` (replicas whose first pass contributes), the
    checker being the next of the `live` replicas: none when fewer than two are live."""
    live = sorted(live)
    checked = {}
    for owner in owners:
        checker = _next(live, owner, {owner})
        if checker is not None and sampled(seed, iteration, owner, rate):
            checked[owner] = checker
    return checked


def arbiter(owner: int, checker: int, live: list[int]) -> int | None:
    """Who runs `owner`'s ids a third time: the next live replica after `checker` that is
    neither of the two."""
    return _next(sorted(live), checker, {owner, checker})


class Fingerprint:
    """A fixed random projection of gradient buckets onto WIDTH values, in float64.

    Bucket `index` gets its own weights (seeded by `seed` and the index), repeated every _TILE
    elements; the same bucket contents give the same bits on every replica."""

    def __init__(self, seed: int):
        self.seed = seed
        self._weights: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _of(self, index: int, device: torch.device) -> torch.Tensor:
        key = (index, device)
        if key not in self._weights:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            weights = torch.randn(_TILE, WIDTH, generator=generator, dtype=torch.float64)
            self._weights[key] = weights.to(device)
        return self._weights[key]

    def bucket(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """The fingerprint of bucket `index`: WIDTH float64 values on the bucket's device (no
        host sync: the owner's are taken during backward with --overlap-grad-reduce)."""
        weights = self._of(index, grad.device)
        flat = grad.detach().view(-1)
        total = torch.zeros(WIDTH, dtype=torch.float64, device=grad.device)
        full = flat.numel() // _TILE * _TILE
        for start in range(0, full, _ROWS * _TILE):
            rows = flat[start:min(full, start + _ROWS * _TILE)].view(-1, _TILE)
            total += (rows.double() @ weights).sum(0)
        if full < flat.numel():
            total += flat[full:].double() @ weights[:flat.numel() - full]
        return total

    def buckets(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The fingerprint of all of a rank's buckets (their sum, in bucket order)."""
        return sum_fingerprints({i: self.bucket(i, g) for i, g in enumerate(grads)})


def sum_fingerprints(by_bucket: dict[int, torch.Tensor]) -> torch.Tensor:
    """Bucket fingerprints summed in bucket order (the same order on owner and checker), on the
    host."""
    total = None
    for index in sorted(by_bucket):
        total = by_bucket[index] if total is None else total + by_bucket[index]
    return torch.zeros(WIDTH, dtype=torch.float64) if total is None else total.cpu()


def close(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    """Equal fingerprints: bitwise at `tolerance` 0, else within `tolerance` of the larger."""
    if tolerance == 0.0:
        return torch.equal(a, b)
    scale = float(torch.maximum(a.abs(), b.abs()).max())
    return float((a - b).abs().max()) <= tolerance * scale


class Slots:
    """The fingerprints' part of the commit lane: per replica id 0..w-1, three slots (its own
    first pass, a checker's run of it, an arbiter's run of it), each a count and WIDTH values.
    Only one replica writes each slot, so the lane's sum holds each fingerprint exactly (with
    distributed-optimizer shards, the sum of the shards', identically on both sides)."""

    KINDS = ("own", "check", "arbiter")

    def __init__(self, w_init: int):
        self.w = w_init
        self.size = w_init * len(self.KINDS) * (1 + WIDTH)

    def _at(self, kind: str, replica: int) -> int:
        return (replica * len(self.KINDS) + self.KINDS.index(kind)) * (1 + WIDTH)

    def encode(self, fingerprints: dict[str, dict[int, torch.Tensor]]) -> torch.Tensor:
        vector = torch.zeros(self.size, dtype=torch.float64)
        for kind, by_replica in fingerprints.items():
            for replica, value in by_replica.items():
                at = self._at(kind, replica)
                vector[at] = 1.0
                vector[at + 1:at + 1 + WIDTH] = value
        return vector

    def decode(self, vector: torch.Tensor) -> dict[str, dict[int, torch.Tensor]]:
        out = {kind: {} for kind in self.KINDS}
        for replica in range(self.w):
            for kind in self.KINDS:
                at = self._at(kind, replica)
                if vector[at] > 0:
                    out[kind][replica] = vector[at + 1:at + 1 + WIDTH].clone()
        return out


@dataclass
class Judgement:
    """What one position's fingerprints say (the same on every replica at the position)."""

    checked: set[int] = field(default_factory=set)  # owners whose two fingerprints were compared
    suspects: set[int] = field(default_factory=set)  # owners to arbitrate
    evict: set[int] = field(default_factory=set)  # replicas that disagree with the other two
    unresolved: set[int] = field(default_factory=set)  # owners nobody can arbitrate


def judge(fingerprints: dict[str, dict[int, torch.Tensor]], checks: dict[int, int],
          live: list[int], tolerance: float) -> Judgement:
    """Compare each checked owner's fingerprint with its checker's; with an arbiter's, name the
    replica that is wrong. Owners or checkers no longer `live` are not judged (their work is
    redone or their check lost with them)."""
    result = Judgement()
    own, check, third = (fingerprints[kind] for kind in Slots.KINDS)
    for owner, checker in sorted(checks.items()):
        if owner not in live or checker not in live or owner not in own or owner not in check:
            continue
        result.checked.add(owner)
        if close(own[owner], check[owner], tolerance):
            continue
        if owner not in third:
            if arbiter(owner, checker, live) is None:
                result.unresolved.add(owner)
            else:
                result.suspects.add(owner)
        elif close(third[owner], check[owner], tolerance) and not close(third[owner],
                                                                          own[owner], tolerance):
            result.evict.add(owner)
        elif close(third[owner], own[owner], tolerance):
            result.evict.add(checker)
        else:
            result.unresolved.add(owner)
    return result
