"""Batch-size schedules (--step-batch-size-schedule) as the global batch of every iteration.
Pure Python.

Megatron-LM core_v0.19.0 steps the global batch size on the samples consumed: its schedule
"THRESHOLD:BS THRESHOLD:BS ..." (megatron-core's StepBatchsizeNumMicroBatchesCalculator) gives
an iteration that starts after `consumed` samples the BS of the last THRESHOLD <= consumed, the
thresholds being tokens (Megatron-LM always passes --seq-length) converted to samples with
`threshold // seq_length`. Every iteration consumes its whole global batch, so the sizes, and
where each iteration's samples start, follow from the arguments alone: every replica computes the
same schedule at launch without exchanging a message.

`parse_step_schedule` parses and validates a schedule as megatron-core does (its arithmetic, its
messages); `GlobalBatches` answers, for any iteration, its size and its first sample
(docs/design.md, "Exact semantics": iteration t's global batch is the sample range
[consumed before t, consumed before t + size of t)). A schedule becomes a ramp, the sizes of the
iterations before its last step, then the last step's size, B: the policy lays every iteration out
within B, so a schedule whose sizes decrease is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

MAX_RAMP_ITERATIONS = 2_000_000
"""The longest ramp (iterations before a schedule's last step) a schedule may have: every replica
holds the size of each of them, and checkpoints carry them (the protocol state's `ramp`)."""

_SUFFIXES = (("T", 1_000_000_000_000), ("B", 1_000_000_000), ("M", 1_000_000), ("K", 1_000))


def _parse_numeric_value(value: str) -> int:
    """megatron-core's StepBatchsizeNumMicroBatchesCalculator._parse_numeric_value: an optional
    K/M/B/T suffix, float arithmetic, int() truncation."""
    value = value.strip().upper()
    multiplier = 1
    for suffix, factor in _SUFFIXES:
        if value.endswith(suffix):
            multiplier, value = factor, value[:-1]
            break
    return int(float(value) * multiplier)


def parse_step_schedule(schedule: str, seq_length: int | None) -> tuple[tuple[int, int], ...]:
    """(threshold in samples, global batch size) of each step of `schedule`, thresholds
    increasing from 0: megatron-core 0.19's parsing (entries split on spaces and commas, tokens
    converted with `// seq_length` when seq_length is given, sorted by threshold) and validation.
    Raises ValueError with megatron-core's message where its calculator would raise or assert."""
    steps = []
    for entry in schedule.strip().replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f'Invalid schedule entry "{entry}". Expected format: '
                             '"THRESHOLD:BATCH_SIZE"')
        threshold_text, size_text = entry.split(":", 1)
        try:
            threshold = _parse_numeric_value(threshold_text)
            size = _parse_numeric_value(size_text)
        except (ValueError, OverflowError) as error:
            raise ValueError(f'Invalid schedule entry "{entry}": {error}') from None
        if seq_length is not None:
            threshold = threshold // seq_length
        steps.append((threshold, size))
    steps.sort(key=lambda step: step[0])
    if not steps:
        raise ValueError("schedule must have at least one entry")
    if steps[0][0] != 0:
        raise ValueError(f"first schedule entry must have threshold 0, got {steps[0][0]}")
    for (before, _), (after, _) in zip(steps, steps[1:]):
        if after <= before:
            raise ValueError(f"schedule thresholds must be strictly increasing, got {before} "
                             f"before {after}")
    for _, size in steps:
        if size <= 0:
            raise ValueError(f"batch size must be positive, got {size}")
    return tuple(steps)


@dataclass(frozen=True)
class GlobalBatches:
    """The global batch of every iteration: `global_batch_size` samples after a ramp phase whose
    iterations have the sizes `ramp` (empty: the same size throughout).

    stepped: from a --step-batch-size-schedule. Megatron-LM's update_train_iters then counts the
    iterations that start before --train-samples are consumed (the last may run past them);
    otherwise the whole global batches in --train-samples.
    """

    global_batch_size: int
    ramp: tuple[int, ...] = ()
    stepped: bool = False

    def __post_init__(self):
        ramp = tuple(self.ramp)
        object.__setattr__(self, "ramp", ramp)
        if self.global_batch_size < 1 or any(not 1 <= s <= self.global_batch_size
                                             for s in set(ramp)):
            raise ValueError(f"global batch sizes must be in 1..{self.global_batch_size}: "
                             f"{sorted(set(ramp))}")
        # The ramp as runs of one size: (first iteration - 1, first sample, size, iterations).
        phases, start = [], 0
        for index, size in enumerate(ramp):
            if phases and phases[-1][2] == size:
                first, sample, _, count = phases[-1]
                phases[-1] = (first, sample, size, count + 1)
            else:
                phases.append((index, start, size, 1))
            start += size
        object.__setattr__(self, "_phases", tuple(phases))
        object.__setattr__(self, "_ramp_samples", start)

    @classmethod
    def of(cls, global_batch_size: int) -> "GlobalBatches":
        """--global-batch-size in every iteration."""
        return _constant(global_batch_size)

    @classmethod
    def of_schedule(cls, schedule: str, seq_length: int | None) -> "GlobalBatches":
        """The global batches of --step-batch-size-schedule `schedule` (thresholds in tokens of
        `seq_length`, or in samples for None): the sizes of the iterations before the schedule's
        last step is reached, then the last step's. Computed once per arguments (callers ask
        every iteration). Raises ValueError for a schedule megatron-core refuses (its message),
        one whose sizes decrease, or one whose ramp is longer than MAX_RAMP_ITERATIONS."""
        return _scheduled(schedule, seq_length)

    def size(self, iteration: int) -> int:
        """Samples in iteration `iteration`'s global batch (iterations count from 1)."""
        self._check(iteration)
        return self.ramp[iteration - 1] if iteration <= len(self.ramp) else self.global_batch_size

    def first_sample(self, iteration: int) -> int:
        """Samples consumed before iteration `iteration`: where its global batch starts."""
        self._check(iteration)
        if iteration > len(self.ramp):
            return self._ramp_samples + (iteration - 1 - len(self.ramp)) * self.global_batch_size
        for first, sample, size, count in reversed(self._phases):
            if first < iteration:
                return sample + (iteration - 1 - first) * size
        raise AssertionError("unreachable: the first phase starts at iteration 1")

    def consumed_after(self, iteration: int) -> int:
        """Samples consumed once iteration `iteration` committed."""
        return self.first_sample(iteration) + self.size(iteration)

    def iterations_in(self, samples: int) -> int:
        """Megatron-LM core_v0.19.0's update_train_iters for --train-samples `samples`: with a
        step schedule, the iterations that start before `samples` are consumed (its loop `while
        consumed < train_samples`); otherwise the whole global batches in `samples`."""
        if self.stepped:
            return self._starting_before(samples)
        return max(0, self._starting_before(samples + 1) - 1)

    def _starting_before(self, samples: int) -> int:
        """How many iterations start with fewer than `samples` samples consumed."""
        count = 0
        for _, sample, size, iterations in self._phases:
            if samples > sample:
                count += min(iterations, -(-(samples - sample) // size))
        if samples > self._ramp_samples:
            count += -(-(samples - self._ramp_samples) // self.global_batch_size)
        return count

    @property
    def ramp_samples(self) -> int:
        """Samples the ramp phase trains (0 without one)."""
        return self._ramp_samples

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every global batch size an iteration has, increasing."""
        return tuple(sorted({*(size for _, _, size, _ in self._phases), self.global_batch_size}))

    @staticmethod
    def _check(iteration: int) -> None:
        if iteration < 1:
            raise ValueError(f"iterations are numbered from 1, got {iteration}")


@lru_cache(maxsize=16)
def _constant(global_batch_size: int) -> GlobalBatches:
    return GlobalBatches(global_batch_size)


@lru_cache(maxsize=16)
def _scheduled(schedule: str, seq_length: int | None) -> GlobalBatches:
    steps = parse_step_schedule(schedule, seq_length)
    phases, consumed, iterations = [], 0, 0  # phases: (size, iterations, first sample)
    for (_, size), (next_threshold, _) in zip(steps, steps[1:]):
        if consumed >= next_threshold:
            continue  # the iterations jump over this step: none starts inside it
        count = -(-(next_threshold - consumed) // size)
        if iterations + count > MAX_RAMP_ITERATIONS:
            raise ValueError(
                f"the schedule reaches its last step (threshold {steps[-1][0]} samples) only "
                f"after more than {MAX_RAMP_ITERATIONS:,} iterations; megatron-recover holds the "
                "batch size of each iteration before it (checkpoints carry them): drop the steps "
                "this run does not reach, or make them coarser")
        phases.append((size, count, consumed))
        consumed += count * size
        iterations += count
    final = steps[-1][1]
    previous = None
    for size, count, first in [*phases, (final, 1, consumed)]:
        if previous is not None and size < previous:
            raise ValueError(
                f"the global batch size decreases from {previous} to {size} at {first} samples; "
                "megatron-recover lays every iteration out within the last step's batch, B, and "
                "takes schedules whose sizes never decrease: give non-decreasing sizes")
        previous = size
    while phases and phases[-1][0] == final:
        phases.pop()  # already the last step's size: part of the constant phase
    ramp = tuple(size for size, count, _ in phases for _ in range(count))
    return GlobalBatches(final, ramp, stepped=True)
