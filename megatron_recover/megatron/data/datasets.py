"""Microbatches by id: megatron-core's GPTDataset addressed as docs/design.md, "Exact semantics",
says.

Contract of `MicrobatchSource(config)`:
- Iteration t (1..train_iters) uses the training split's samples [(t-1)*GBS, t*GBS), the range
  Megatron's pretraining sampler gives iteration t; with a batch-size schedule, the GBS_t
  samples after those the earlier iterations consumed (`GlobalBatches`). Microbatch id k,
  0 <= k < B_t = GBS_t / mbs, is the k-th slice of `micro_batch_size` samples in it.
  (Megatron's sampler hands data-parallel rank r of dp its m-th microbatch of an iteration from
  slice m*dp + r.)
- Reserve ids B + j, 0 <= j < reserve_microbatches, are the run-wide reserve stream (the policy's
  reserve mode): samples [main_samples + j*mbs, +mbs), whatever the iteration, where main_samples
  is the training split's size (--train-samples, or what train_iters iterations consume). They
  lie after every main-stream sample, so a reserve id never repeats a training sample.
- `microbatch(t, k)` returns Megatron's GPT batch as CPU tensors: tokens, labels, position_ids
  (int64 [mbs, seq]), loss_mask (float32 [mbs, seq], as megatron-core makes it) and
  attention_mask: None by default, because megatron-core's attention builds the causal mask
  itself when given None (AttnMaskType.causal, Megatron-LM's
  --no-create-attention-mask-in-dataloader), or bool [mbs, 1, seq, seq] (True = masked) with
  `create_attention_mask`. The batch also names itself: `iteration` and `microbatch_id` (ints),
  which the schedule's forward step reads to register the microbatch in the gradient ledger.
- Determinism: the same config gives bitwise the same microbatch in every process and run, built
  or loaded from the cache, because megatron-core's indices are seeded by `seed` alone.

The data set is what Megatron-LM's pretrain_gpt builds: `BlendedMegatronDatasetBuilder` over
`GPTDataset` with `GPTDatasetConfig`, a training split of split_samples samples, so the main stream
equals an unpatched megatron-core run with the same data, --seed, --split, --seq-length,
--global-batch-size (or --step-batch-size-schedule) and --reset-position-ids /
--reset-attention-mask / --eod-mask-loss (all off by default). `blend` is megatron's blend, as
megatron-core's `get_blend_from_list` makes it from --data-path: one prefix without a weight is one
GPTDataset; several prefixes, or any weights, give megatron's `BlendedDataset` over their
GPTDatasets, whose sample i is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`.
`blend_per_split` (--train-data-path, --valid-data-path, --test-data-path) gives each split its own
blend, used whole, instead of `blend` cut by `split`. Neither gives megatron's `MockGPTDataset`
(--mock-data; megatron then ignores `split`).
GPTDataset rounds its size up to whole epochs, so the reserve stream usually fits after the main
one; when it does not, the split is built for main + reserve samples, which may add an epoch and
so reshuffle the main stream (reserve mode only: exact mode has no reserve stream; and a
schedule's last iteration past --train-samples when the epochs' slack does not hold it, where
Megatron-LM's sampler would run out).

Start-up, cache and concurrency. Build the source before torch.distributed is initialized
(RuntimeError otherwise): megatron's builder then takes its single-process path, building or
loading the index cache itself, with no barrier and no rank 0 to wait for. (Once torch.distributed
is up, megatron builds on global rank 0 behind world-wide barriers that every rank must enter: a
hang if only some ranks build a source, and a dependency on one rank.) The index files (.npy)
live in `cache_dir`, by default megatron's own `<prefix>/cache/GPTDataset_indices` of each
dataset (a blend's own index is then not cached, as in megatron). Processes that build at the
same time take turns under an exclusive flock on `.build.lock` in each of those directories
(taken in sorted order): the first writes the indices, the others find and memory-map them. So any
number of ranks, on one host or on a shared file system with working flock, may build at once;
without flock, give each host its own `cache_dir`. A process killed while writing the cache may
leave a truncated file that megatron would load later: remove the cache directory after a crash
during start-up. Mock data is built in memory and not cached (megatron's behaviour).
"""

import contextlib
import fcntl
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from megatron_recover.policy.rampup import GlobalBatches
from megatron_recover.recovery.ledger import CHECKSUM_MODULUS

LOCK_NAME = ".build.lock"

# Megatron-LM's defaults for --split and --seed.
DEFAULT_SPLIT = "969,30,1"
DEFAULT_SEED = 1234

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def split_is_valid(split) -> bool:
    """Whether megatron-core's parse_and_normalize_split reads `split` (its numbers, as floats)
    into one to three weights with a positive training weight; it only asserts otherwise."""
    try:
        weights = ([float(w) for w in re.findall(r"[.0-9]+", split)]
                   if isinstance(split, str) else [])
    except ValueError:  # "1.2.3", "."
        return False
    return 1 <= len(weights) <= 3 and weights[0] > 0


def batch_checksum(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> int:
    """A checksum of what a microbatch trains on (its tokens, labels and loss mask), in
    [0, 2^31 - 1) so that sums of them ride exactly in the float64 commit lane. Equal batches give
    equal checksums in every process."""
    digest = hashlib.blake2b(digest_size=8)
    for tensor, dtype in ((tokens, torch.int64), (labels, torch.int64),
                          (loss_mask, torch.float32)):
        digest.update(tensor.detach().to("cpu", dtype).contiguous().view(-1).numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") % CHECKSUM_MODULUS


@dataclass(frozen=True)
class MicrobatchSourceConfig:
    """Everything that decides which samples a microbatch id holds; validated on creation.

    tokenizer: from `megatron_recover.megatron.data.tokenizers.build_tokenizer` (needs eod, vocab_size,
        unique_identifiers); it must be the one the data was preprocessed with.
    sequence_length: tokens per sample (--seq-length).
    micro_batch_size: samples per microbatch (--micro-batch-size).
    global_batch_size: samples per iteration (--global-batch-size), a multiple of
        micro_batch_size; B = global_batch_size / micro_batch_size.
    train_iters: iterations of the run (--train-iters, or Megatron-LM's count for
        --train-samples).
    train_samples: the training split's size, where the reserve stream starts: --train-samples
        of a sample-based run (as Megatron-LM builds its split); None: what the iterations
        consume. With a schedule the last iteration may read past it (Megatron-LM runs it
        whole): the main stream and the split then extend to what the iterations consume.
    step_batch_size_schedule: --step-batch-size-schedule, thresholds in tokens of
        sequence_length, or None; global_batch_size is then its last step's size. Iteration
        t's global batch starts after the samples the earlier iterations consumed and holds
        that iteration's size (`GlobalBatches`); microbatch ids of iteration t are 0..B_t-1.
    eval_global_batch_size: samples per evaluation iteration (Megatron-LM's
        args.global_batch_size: mbs x dp with a schedule); None: global_batch_size.
    blend: (prefixes of .bin/.idx pairs, their weights or None), megatron's blend of --data-path;
        None for mock data (--mock-data) or per-split blends.
    blend_per_split: (train, valid, test), each a blend or None, megatron's blend_per_split of
        the per-split paths; `split` is then None. The train blend is required.
    split: train/valid/test weights as in --split (evaluation reads the validation and test
        splits). May be None with mock data (megatron ignores it there).
    seed: megatron's dataset shuffle seed (--seed).
    reserve_microbatches: length of the reserve stream in microbatches (reserve mode; 0 in
        exact mode).
    cache_dir: where megatron caches its index files (--data-cache-path); None: megatron's
        default beside the data. Unused with mock data.
    eval_iters, evaluations: global batches per evaluation (--eval-iters) and evaluations of the
        validation split in the run; the validation split is then built with
        evaluations x eval_iters x E samples and the test split with eval_iters x E, as
        Megatron-LM sizes them (0: neither is read), E being eval_global_batch_size.
    create_attention_mask: put a dense causal mask in each batch instead of None.
    reset_position_ids, reset_attention_mask, eod_mask_loss: Megatron-LM's flags of those names
        (restart positions / block attention after each EOD, drop EOD from the loss); a reset
        attention mask needs create_attention_mask, since None stands for the plain causal mask.
    """

    tokenizer: Any
    sequence_length: int
    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    train_samples: Optional[int] = None
    step_batch_size_schedule: Optional[str] = None
    eval_global_batch_size: Optional[int] = None
    blend: Optional[tuple] = None
    blend_per_split: Optional[tuple] = None
    split: Optional[str] = DEFAULT_SPLIT
    seed: int = DEFAULT_SEED
    reserve_microbatches: int = 0
    cache_dir: Optional[str] = None
    eval_iters: int = 0
    evaluations: int = 0
    create_attention_mask: bool = False
    mmap_bin_files: bool = True
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def __post_init__(self):
        for name in ("sequence_length", "micro_batch_size", "global_batch_size", "train_iters"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.batches.global_batch_size != self.global_batch_size:
            raise ValueError(f"global_batch_size {self.global_batch_size} is not the last step "
                             f"of the batch-size schedule ({self.batches.global_batch_size})")
        if any(size % self.micro_batch_size for size in self.batches.sizes):
            raise ValueError(
                f"every global batch size ({list(self.batches.sizes)}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        if self.eval_global_batch_size is not None and (
                self.eval_global_batch_size < 1
                or self.eval_global_batch_size % self.micro_batch_size):
            raise ValueError(f"eval_global_batch_size {self.eval_global_batch_size} must be a "
                             f"positive multiple of micro_batch_size ({self.micro_batch_size})")
        consumed = self.batches.consumed_after(self.train_iters)
        if self.train_samples is not None and self.train_samples < consumed \
                and not self.batches.stepped:
            raise ValueError(f"train_samples ({self.train_samples}) is less than the "
                             f"{consumed} samples {self.train_iters} iterations consume")
        _check_int("reserve_microbatches", self.reserve_microbatches, minimum=0)
        _check_int("eval_iters", self.eval_iters, minimum=0)
        _check_int("evaluations", self.evaluations, minimum=0)
        _check_int("seed", self.seed, minimum=0)
        for attribute in ("eod", "vocab_size", "unique_identifiers"):
            if not hasattr(self.tokenizer, attribute):
                raise ValueError(f"tokenizer has no {attribute!r}; build it with build_tokenizer")
        if self.reset_attention_mask and not self.create_attention_mask:
            raise ValueError(
                "reset_attention_mask needs create_attention_mask: without a mask in the batch "
                "the model applies the plain causal mask"
            )
        if self.blend_per_split is not None:
            if self.blend is not None or self.split is not None:
                raise ValueError("blend_per_split excludes blend and split (each split's blend "
                                 "is used whole)")
            if len(self.blend_per_split) != 3 or self.blend_per_split[0] is None:
                raise ValueError("blend_per_split is (train, valid, test), with a train blend")
        elif self.blend is not None or self.split is not None:
            _check_split(self.split)
        for blend in self.blends:
            prefixes, weights = blend
            if not prefixes or (weights is not None and (
                    len(weights) != len(prefixes) or min(weights) < 0 or sum(weights) <= 0)):
                raise ValueError(f"blend {blend!r}: give one or more prefixes and either no "
                                 "weights or one non-negative weight each, not all zero")
            for prefix in prefixes:
                for suffix in (".bin", ".idx"):
                    if not os.path.isfile(prefix + suffix):
                        raise ValueError(
                            f"blend prefix {prefix!r}: {prefix + suffix} not found (a prefix "
                            f"names the .bin/.idx pair, without the suffix)"
                        )
                _check_vocabulary(prefix, self.tokenizer.vocab_size)

    @property
    def blends(self) -> list[tuple]:
        """Every blend given: `blend`, or the per-split ones."""
        if self.blend_per_split is not None:
            return [blend for blend in self.blend_per_split if blend is not None]
        return [] if self.blend is None else [self.blend]

    @property
    def batches(self) -> GlobalBatches:
        """The global batch of every iteration (a batch-size schedule's included)."""
        if self.step_batch_size_schedule is None:
            return GlobalBatches.of(self.global_batch_size)
        return GlobalBatches.of_schedule(self.step_batch_size_schedule, self.sequence_length)

    @property
    def microbatches_per_iteration(self) -> int:
        """B (a schedule's last step); reserve-stream ids start there (id B + j)."""
        return self.global_batch_size // self.micro_batch_size

    @property
    def eval_batch_size(self) -> int:
        """Samples per evaluation iteration."""
        return self.eval_global_batch_size or self.global_batch_size

    @property
    def split_samples(self) -> int:
        """The training split's size as Megatron-LM asks megatron-core for it: train_samples,
        or what train_iters iterations consume."""
        if self.train_samples is not None:
            return self.train_samples
        return self.batches.consumed_after(self.train_iters)

    @property
    def main_samples(self) -> int:
        """Training samples of the main stream: the split's size, or what the iterations
        consume where a schedule's last iteration reads past it."""
        return max(self.split_samples, self.batches.consumed_after(self.train_iters))

    @property
    def num_samples(self) -> int:
        """Training samples the run may read: the main stream, then the reserve stream."""
        return self.main_samples + self.reserve_microbatches * self.micro_batch_size


class MicrobatchSource:
    """Megatron GPT batches by (iteration, microbatch id); see the module docstring."""

    def __init__(self, config: MicrobatchSourceConfig):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RuntimeError(
                "build the MicrobatchSource before torch.distributed is initialized: megatron's "
                "dataset builder would otherwise build on global rank 0 behind world-wide barriers"
            )
        self.config = config
        self.batches = config.batches
        self.dataset, valid, test = _build_splits(config)
        # Megatron-LM evaluates a split only if --split gives it documents.
        self.eval_datasets = {name: dataset for name, dataset in (("valid", valid), ("test", test))
                              if dataset is not None and config.eval_iters > 0}

    @property
    def eval_microbatches(self) -> int:
        """Microbatches in one evaluation: eval_iters evaluation batches (of B, or of mbs x dp
        with a batch-size schedule, as Megatron-LM)."""
        return self.config.eval_iters * self.config.eval_batch_size // self.config.micro_batch_size

    def eval_microbatch(self, split: str, evaluation: int, index: int) -> Dict[str, Any]:
        """Microbatch `index` (0 <= index < eval_microbatches) of evaluation number `evaluation`
        (1, 2, ...) of the "valid" or "test" split: as Megatron-LM's validation iterator reads
        the split, evaluation k covers its samples [(k-1) E mbs, k E mbs) with E =
        eval_microbatches, in order. The batch names itself (`split`, `evaluation`, `index`)."""
        config = self.config
        count = self.eval_microbatches
        if not 0 <= index < count:
            raise ValueError(f"evaluation microbatch {index} is outside 0..{count - 1}")
        dataset = self.eval_datasets[split]
        start = ((evaluation - 1) * count + index) * config.micro_batch_size
        if evaluation < 1 or start + config.micro_batch_size > len(dataset):
            raise ValueError(f"evaluation {evaluation} of the {split} split is past its "
                             f"{len(dataset)} samples")
        batch = _stack([dataset[i] for i in range(start, start + config.micro_batch_size)])
        return {**batch, "split": split, "evaluation": evaluation, "index": index}

    def sample_range(self, iteration: int, microbatch_id: int) -> range:
        """The training-split sample indices (before megatron's shuffle) of one microbatch."""
        config = self.config
        b = config.microbatches_per_iteration
        if not 1 <= iteration <= config.train_iters:
            raise ValueError(f"iteration {iteration} is outside 1..{config.train_iters}")
        mbs = config.micro_batch_size
        b_t = self.batches.size(iteration) // mbs
        if not (0 <= microbatch_id < b_t or b <= microbatch_id < b + config.reserve_microbatches):
            raise ValueError(
                f"microbatch id {microbatch_id} of iteration {iteration} is outside "
                f"0..{b_t - 1} (main stream) and {b}..{b + config.reserve_microbatches - 1} "
                "(reserve stream)"
            )
        if microbatch_id < b:
            start = self.batches.first_sample(iteration) + microbatch_id * mbs
        else:
            start = config.main_samples + (microbatch_id - b) * mbs
        return range(start, start + mbs)

    def microbatch(self, iteration: int, microbatch_id: int) -> Dict[str, Optional[torch.Tensor]]:
        """Megatron's GPT batch for one microbatch id of one iteration, as CPU tensors."""
        samples = [self.dataset[index] for index in self.sample_range(iteration, microbatch_id)]
        return {**_stack(samples), "iteration": iteration, "microbatch_id": microbatch_id}


def _stack(samples) -> Dict[str, Optional[torch.Tensor]]:
    return {key: torch.stack([sample[key] for sample in samples]) if key in samples[0] else None
            for key in BATCH_KEYS}


def _build_splits(config: MicrobatchSourceConfig):
    """(train, valid, test): megatron builds each split from its own documents with its own
    size, so the evaluation sizes do not change the training split."""
    gbs = config.eval_batch_size
    weighted = any(weights is not None for _, weights in config.blends)
    if config.eval_iters or weighted:
        # Megatron-LM's sizes (0 without evaluation: megatron-core wants a size for every split
        # of a weighted blend).
        evaluation = [config.evaluations * config.eval_iters * gbs, config.eval_iters * gbs]
    else:
        evaluation = [None, None]  # one epoch of each split, never read
    if config.blend is not None:
        _check_splits_have_documents(config, sized=[True] + [n is not None for n in evaluation])
    train, valid, test = _build(config, [config.split_samples, *evaluation])
    if len(train) < config.num_samples:
        # The whole-epoch slack after the split is too short for the reserve stream, or for
        # the last iteration of a schedule that reads past --train-samples.
        train = _build(config, [config.num_samples, *evaluation])[0]
    return train, valid, test


def _check_splits_have_documents(config: MicrobatchSourceConfig, sized: list[bool]) -> None:
    """Refuse a --split that gives a dataset no documents in a split megatron-core builds with a
    size: it would loop for ever looking for the tokens of one more sample (megatron-core's
    GPTDataset._get_num_epochs, 0.16.1 and 0.19.0 alike). The split arithmetic is
    megatron-core's."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(config.split))
    for prefix in config.blend[0]:
        documents = IndexedDataset(prefix).sequence_lengths.shape[0]
        for name, bounds, built in zip(("train", "valid", "test"), matrix, sized):
            if built and bounds is not None and (
                    int(round(bounds[1] * documents)) <= int(round(bounds[0] * documents))):
                raise ValueError(
                    f"--split {config.split}: {prefix} has {documents} documents and gets none "
                    f"in the {name} split: give that split a larger share, or 0 to build none "
                    f"(a {name} split is read only with --eval-iters > 0)")


def _build(config: MicrobatchSourceConfig, sizes: list):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    mock = not config.blends
    cache_dir = None if mock else config.cache_dir and os.path.abspath(config.cache_dir)
    builder = BlendedMegatronDatasetBuilder(
        MockGPTDataset if mock else GPTDataset,
        # The builder builds every split with a weight (None: one epoch), and the weights
        # decide which documents train, exactly as in megatron.
        sizes,
        lambda: True,
        _gpt_dataset_config(config, cache_dir),
    )
    with contextlib.nullcontext() if mock else _exclusive_locks(_lock_dirs(config)):
        return builder.build()


def _gpt_dataset_config(config: MicrobatchSourceConfig, cache_dir: Optional[str]):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    def megatrons(blend):
        if blend is None:
            return None
        prefixes, weights = blend
        return ([os.path.abspath(p) for p in prefixes],
                None if weights is None else [float(w) for w in weights])

    per_split = config.blend_per_split
    return GPTDatasetConfig(
        random_seed=config.seed,
        sequence_length=config.sequence_length,
        blend=megatrons(config.blend),
        blend_per_split=None if per_split is None else [megatrons(b) for b in per_split],
        split=config.split,
        path_to_cache=cache_dir,
        tokenizer=config.tokenizer,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=config.create_attention_mask,
        mmap_bin_files=config.mmap_bin_files,
    )


def _lock_dirs(config: MicrobatchSourceConfig) -> list[str]:
    """Where the build writes index files: --data-cache-path, or megatron-core's default for
    path_to_cache=None, each dataset's `<prefix>/cache/GPTDataset_indices`."""
    if config.cache_dir is not None:
        return [os.path.abspath(config.cache_dir)]
    return sorted({os.path.join(os.path.abspath(prefix), "cache", "GPTDataset_indices")
                   for blend in config.blends for prefix in blend[0]})


@contextlib.contextmanager
def _exclusive_locks(directories: list[str]):
    """Hold an exclusive flock on directory/.build.lock of each directory, taken in the given
    (sorted) order so that two builders never wait on each other (released at exit, or if we
    die)."""
    with contextlib.ExitStack() as stack:
        for directory in directories:
            os.makedirs(directory, exist_ok=True)
            lock_file = stack.enter_context(open(os.path.join(directory, LOCK_NAME), "a"))
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            stack.callback(fcntl.flock, lock_file, fcntl.LOCK_UN)
        yield


# Tokens of each dataset that start-up reads to check that they lie inside the vocabulary:
# 128 KiB of uint16 per prefix and rank, so a blend of hundreds of corpora starts quickly.
VOCABULARY_CHECK_TOKENS = 1 << 16


def _check_vocabulary(prefix: str, vocab_size: int) -> None:
    """Refuse a dataset preprocessed with another vocabulary than the tokenizer's: its token
    dtype is not the one Megatron's preprocessing writes for this vocabulary size
    (`DType.optimal_dtype`), or one of its first `VOCABULARY_CHECK_TOKENS` ids lies outside it.
    The id check is bounded so that start-up does not read a whole corpus; a dataset from a
    tokenizer of the same size and dtype passes it."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset

    dataset = IndexedDataset(prefix)
    expected = DType.optimal_dtype(vocab_size)
    remedy = ("preprocess it with this run's tokenizer (scripts/preprocess_data.py), or train "
              "with the tokenizer it was made with")
    if dataset.index.dtype != expected:
        raise ValueError(
            f"--data-path {prefix}: its tokens are {numpy.dtype(dataset.index.dtype).name}, "
            f"while Megatron's preprocessing writes {numpy.dtype(expected).name} for this "
            f"tokenizer's {vocab_size} ids, so it was made with another vocabulary: {remedy}")
    # The .bin file is the documents' tokens back to back, from its first byte: its size counts
    # them without reading the index's sequence lengths (one per sequence of the corpus).
    tokens = os.path.getsize(prefix + ".bin") // numpy.dtype(expected).itemsize
    count = min(tokens, VOCABULARY_CHECK_TOKENS)
    if count == 0:
        return
    largest = int(numpy.fromfile(prefix + ".bin", dtype=expected, count=count).max())
    if largest >= vocab_size:
        raise ValueError(
            f"--data-path {prefix}: token id {largest} among its first {count} tokens is outside "
            f"this tokenizer's {vocab_size} ids, so it was made with another vocabulary: {remedy}")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_split(split: str) -> None:
    if not split_is_valid(split):
        raise ValueError(
            f"split must be up to three comma-separated weights for train, valid, test with a "
            f"positive training weight, e.g. '969,30,1' or '100,0,0'; got {split!r}"
        )
