"""Batch-size ramp-up (--rampup-batch-size) as a schedule of global batches. Pure Python.

Megatron-LM's ramp-up grows the global batch from START by INCR samples at a time over
SAMPLES training samples: before an iteration that starts after `consumed` samples, the global
batch size is START + INCR * floor(consumed / (SAMPLES / n)) with n = (GBS - START) / INCR
increments, and GBS once `consumed` exceeds SAMPLES. Every iteration consumes its whole global
batch, so the sizes, and where each iteration's samples start, follow from the arguments alone:
every replica computes the same schedule at launch without exchanging a message.

`ramp_up` gives the sizes of the ramp phase; `GlobalBatches` answers, for any iteration, its size
and its first sample (docs/design.md, "Exact semantics": iteration t's global batch is the sample
range [consumed before t, consumed before t + size of t)).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate


def ramp_up(start: int, increment: int, ramp_samples: int, global_batch_size: int
            ) -> tuple[int, ...]:
    """The global batch size of each iteration of the ramp phase, iteration 1 first.

    The ramp phase is every iteration that starts with at most `ramp_samples` consumed (as
    Megatron-LM's update_train_iters counts it); all later iterations have `global_batch_size`.
    Raises ValueError where Megatron's RampupBatchsizeNumMicroBatchesCalculator would assert
    (or, for ramp_samples 0, divide by zero).
    """
    for name, value, minimum in (("start", start, 1), ("increment", increment, 1),
                                 ("ramp_samples", ramp_samples, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"ramp-up {name} must be an integer >= {minimum}, got {value!r}")
    diff = global_batch_size - start
    if diff <= 0 or diff % increment:
        raise ValueError(f"the ramp-up goes from {start} to the global batch size "
                         f"{global_batch_size} in steps of {increment}: the difference must be a "
                         "positive multiple of the step")
    samples_per_increment = ramp_samples / (diff // increment)
    sizes = []
    consumed = 0
    while consumed <= ramp_samples:
        # Megatron's arithmetic, float division and int() included, so the steps land on the
        # same iterations as in Megatron-LM.
        size = start + int(consumed / samples_per_increment) * increment
        sizes.append(min(size, global_batch_size))
        consumed += sizes[-1]
    return tuple(sizes)


@dataclass(frozen=True)
class GlobalBatches:
    """The global batch of every iteration: `global_batch_size` samples after a ramp phase whose
    iterations have the sizes `ramp` (empty: no ramp-up)."""

    global_batch_size: int
    ramp: tuple[int, ...] = ()

    def __post_init__(self):
        if self.global_batch_size < 1 or any(not 1 <= s <= self.global_batch_size
                                             for s in self.ramp):
            raise ValueError(f"global batch sizes must be in 1..{self.global_batch_size}: "
                             f"{self.ramp}")
        object.__setattr__(self, "_starts", (0, *accumulate(self.ramp)))

    @classmethod
    def of(cls, global_batch_size: int, rampup: tuple[int, int, int] | None = None
           ) -> "GlobalBatches":
        """The schedule of --global-batch-size and --rampup-batch-size START INCREMENT SAMPLES
        (None: no ramp-up). Computed once per arguments: callers ask for it every iteration."""
        return _global_batches(global_batch_size, None if rampup is None else tuple(rampup))

    def size(self, iteration: int) -> int:
        """Samples in iteration `iteration`'s global batch (iterations count from 1)."""
        self._check(iteration)
        return self.ramp[iteration - 1] if iteration <= len(self.ramp) else self.global_batch_size

    def first_sample(self, iteration: int) -> int:
        """Samples consumed before iteration `iteration`: where its global batch starts."""
        self._check(iteration)
        ramped = min(iteration - 1, len(self.ramp))
        return self._starts[ramped] + (iteration - 1 - ramped) * self.global_batch_size

    def consumed_after(self, iteration: int) -> int:
        """Samples consumed once iteration `iteration` committed."""
        return self.first_sample(iteration) + self.size(iteration)

    def iterations_in(self, samples: int) -> int:
        """Megatron-LM's update_train_iters: the iterations whose whole global batch lies in
        `samples` training samples after the ramp phase (a partial last batch is dropped).
        Raises ValueError when the ramp phase alone needs more than `samples`."""
        if samples < self.ramp_samples:
            raise ValueError(f"{samples} training samples end inside the batch-size ramp-up, "
                             f"which trains {self.ramp_samples} samples")
        return len(self.ramp) + (samples - self.ramp_samples) // self.global_batch_size

    @property
    def ramp_samples(self) -> int:
        """Samples the ramp phase trains (0 without ramp-up)."""
        return self._starts[-1]

    @staticmethod
    def _check(iteration: int) -> None:
        if iteration < 1:
            raise ValueError(f"iterations are numbered from 1, got {iteration}")


@lru_cache(maxsize=16)
def _global_batches(global_batch_size: int, rampup: tuple[int, int, int] | None) -> GlobalBatches:
    ramp = () if rampup is None else ramp_up(*rampup, global_batch_size=global_batch_size)
    return GlobalBatches(global_batch_size, ramp)
