"""The per-iteration invariant: what the buckets committed against what the failure-free run uses.

The committed side comes from the gradient ledger (layer 2) as the commit lane summed it: which
(iteration, id) gradients the reduced buckets held and the sum of the checksums of the batches the
schedule consumed. The expected side is computed here without the policy: from the microbatch ids
an iteration has by definition (docs/design.md, "Exact semantics") and from megatron's `GPTDataset`,
indexed directly rather than through `MicrobatchSource` (for a blend, through megatron's blend
index arrays: sample i is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`).

  exact      ids 0..B_t-1 of the iteration, each exactly once, and their dataset checksums;
  reserve    B_t distinct ids; reserve ids (>= B) never committed before in the run;
  adaptive   distinct failure-free ids, as many as the loss was divided by.
In every mode the checksum sum equals the dataset checksums of the ids committed, no entry belongs
to another iteration and no bucket was reduced with contents the ledger could not name; with
--calculate-per-token-loss the loss tokens the commit lane counted (what the gradient is divided
by) equal the unmasked tokens of those ids' samples in the dataset. B_t, the
iteration's global batch in microbatches, and where its samples start come from megatron-core's own
microbatch calculator stepped through the run's consumed samples (a batch-size schedule changes
them: megatron-core's StepBatchsizeNumMicroBatchesCalculator), not from the `GlobalBatches` the
policy and the data source share.
"""

from __future__ import annotations

import torch

from megatron_recover.megatron.data.datasets import batch_checksum
from megatron_recover.policy import ADAPTIVE, RESERVE
from megatron_recover.recovery import LaneTotals


class DatasetAudit:
    """Checks one position's summed lane each round; keeps the run's committed reserve ids.

    dataset: megatron's training-split dataset (`MicrobatchSource.dataset`), indexed by sample.
    The sample arithmetic (iteration t's global batch is the GBS_t samples after those consumed
    before it; reserve id B+j is samples main_samples + j*mbs onwards, main_samples being the
    training split's size) is docs/design.md's ("Exact semantics"), written out again on purpose.
    step_batch_size_schedule: --step-batch-size-schedule, or None; seq_length: --seq-length,
    which converts its thresholds from tokens to samples (as Megatron-LM passes it).
    """

    def __init__(self, dataset, *, global_batch_size: int, micro_batch_size: int,
                 main_samples: int, policy: str, mode: str,
                 step_batch_size_schedule: str | None = None, seq_length: int | None = None,
                 committed_reserve=()):
        """`committed_reserve`: reserve ids a run being continued (a standby's join) committed."""
        from megatron.core.num_microbatches_calculator import (
            ConstantNumMicroBatchesCalculator,
            StepBatchsizeNumMicroBatchesCalculator,
        )

        self.dataset = dataset
        self.mbs = micro_batch_size
        self.b = global_batch_size // micro_batch_size
        self.main_samples = main_samples
        self.policy = policy
        self.mode = mode
        self._checksums: dict[tuple[int, int], tuple[int, int]] = {}  # -> (checksum, tokens)
        self._committed_reserve: set[int] = set(committed_reserve)
        # Data-parallel size 1: only the global batch sizes are read, not per-rank counts.
        if step_batch_size_schedule is None:
            self._calculator = ConstantNumMicroBatchesCalculator(
                global_batch_size, micro_batch_size, 1, False, -1)
        else:
            self._calculator = StepBatchsizeNumMicroBatchesCalculator(
                micro_batch_size, 1, False, -1, step_batch_size_schedule, seq_length)
        self._batches: list[tuple[int, int]] = []  # (first sample, size) of iterations 1, 2, ...

    def global_batch(self, iteration: int) -> tuple[int, int]:
        """(first sample, samples) of `iteration`'s global batch, as Megatron-LM's loop has it:
        the calculator updated with the samples consumed so far, each iteration consuming its
        current global batch size."""
        while len(self._batches) < iteration:
            first = sum(self._batches[-1]) if self._batches else 0
            self._calculator.update(first, consistency_check=False)
            self._batches.append((first, self._calculator.get_current_global_batch_size()))
        return self._batches[iteration - 1]

    def checksum(self, iteration: int, microbatch_id: int) -> int:
        return self._microbatch(iteration, microbatch_id)[0]

    def tokens(self, iteration: int, microbatch_id: int) -> int:
        """The microbatch's loss tokens: its samples' unmasked positions."""
        return self._microbatch(iteration, microbatch_id)[1]

    def _microbatch(self, iteration: int, microbatch_id: int) -> tuple[int, int]:
        key = (iteration, microbatch_id)
        if key not in self._checksums:
            if microbatch_id < self.b:
                first = self.global_batch(iteration)[0] + microbatch_id * self.mbs
            else:
                first = self.main_samples + (microbatch_id - self.b) * self.mbs
            samples = [self._sample(i) for i in range(first, first + self.mbs)]
            tokens, labels, loss_mask = (torch.stack([s[k] for s in samples])
                                         for k in ("tokens", "labels", "loss_mask"))
            self._checksums[key] = (batch_checksum(tokens, labels, loss_mask),
                                    int(loss_mask.sum().item()))
            if len(self._checksums) > 8 * self.b:  # keep the cache to a few iterations
                self._checksums.pop(next(iter(self._checksums)))
        return self._checksums[key]

    def _sample(self, index: int) -> dict:
        """Training sample `index`; of a blend, read from its dataset through megatron's index."""
        blend = self.dataset
        if not hasattr(blend, "dataset_sample_index"):
            return blend[index]
        if blend.dataset_index is None:
            blend[index]  # megatron maps a cached blend index on first access
        dataset = blend.datasets[int(blend.dataset_index[index])]
        return dataset[int(blend.dataset_sample_index[index])]

    def share(self, iteration: int, index: int, count: int) -> dict[int, tuple[int, int]]:
        """The expected (checksum, loss tokens) of the main ids k < B_t with k % count ==
        index: this rank's share of the expected side, when the `count` contributors to a
        lane split it (each reads 1/count of the iteration's samples, not all of them)."""
        b = self.global_batch(iteration)[1] // self.mbs
        return {k: self._microbatch(iteration, k) for k in range(index, b, count)}

    def problems(self, iteration: int, totals: LaneTotals, divisor: int,
                 tokens: int | None = None,
                 expected: dict[int, tuple[int, int]] | None = None) -> list[str]:
        """What is wrong with the committed ledger `totals` of `iteration` (empty: the invariant
        holds). `divisor`: how many microbatches the iteration's loss and gradient are divided
        by; `tokens`: with per-token loss, the loss tokens the commit lane counted (None: not
        checked here); `expected`: the main ids' (checksum, tokens) as the lane's shares summed
        them (`share`), None: read here for every id. Reserve ids are always read here."""
        problems = []
        if totals.poison:
            problems.append(f"{totals.poison} bucket(s) reduced with contents the ledger cannot "
                            "name, or a rank whose buckets' ledgers disagree")
        if totals.foreign:
            problems.append(f"{totals.foreign} gradient(s) of another iteration")
        if totals.reserve_clash:
            problems.append(f"reserve ids held twice ({totals.reserve_clash} entries)")
        twice = [k for k, n in enumerate(totals.main_counts) if n > 1]
        if twice:
            problems.append(f"ids held more than once: {twice}")
        b = self.global_batch(iteration)[1] // self.mbs
        beyond = [k for k in totals.main_ids if k >= b]
        if beyond:
            problems.append(f"ids beyond the iteration's B = {b}: {beyond}")
        main = totals.main_ids
        if self.mode == RESERVE and self.policy != ADAPTIVE:
            if totals.count != b:
                problems.append(f"{totals.count} microbatch gradients, B = {b}")
            again = sorted(self._committed_reserve.intersection(totals.reserve))
            if again:
                problems.append(f"reserve ids committed in an earlier iteration: {again}")
        elif self.policy == ADAPTIVE:
            if totals.reserve:
                problems.append(f"reserve ids {list(totals.reserve)} in drop-and-go")
            if totals.count != divisor:
                problems.append(f"{totals.count} microbatch gradients, divided by {divisor}")
        else:
            missing = [k for k, n in enumerate(totals.main_counts[:b]) if n == 0]
            if missing:
                problems.append(f"ids missing: {missing}")
            if totals.reserve:
                problems.append(f"reserve ids {list(totals.reserve)} in exact mode")
        counts = {k: n for k, n in enumerate(totals.main_counts) if n > 0}
        counts.update((k, 1) for k in totals.reserve)
        unshared = [] if expected is None else sorted(k for k in counts
                                                      if k < b and k not in expected)
        if unshared:
            problems.append(f"the expected side of ids {unshared} was not computed exactly "
                            "once by the lane's shares")

        def value(k: int) -> tuple[int, int]:
            if expected is None or k >= b:
                return self._microbatch(iteration, k)
            return expected.get(k, (0, 0))

        want = sum(n * value(k)[0] for k, n in counts.items())
        if totals.checksum != want:
            problems.append(f"batch checksums {totals.checksum} != {want} from the dataset")
        if tokens is not None:
            want = sum(n * value(k)[1] for k, n in counts.items())
            if tokens != want:
                problems.append(f"{tokens} loss tokens counted, {want} in the dataset's "
                                "samples of the committed ids")
        return problems

    @property
    def committed_reserve(self) -> frozenset[int]:
        """Reserve ids committed so far in the run (a joiner continues from a live replica's)."""
        return frozenset(self._committed_reserve)

    def committed(self, totals: LaneTotals) -> None:
        """The iteration committed: its reserve ids may not come again."""
        self._committed_reserve.update(totals.reserve)
