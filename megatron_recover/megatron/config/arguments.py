"""Megatron's GPT arguments for `pretrain_gpt_recover.py`: parse, validate, derive a TrainConfig.

Users keep their Megatron-LM command lines, so every argument here has Megatron-LM's name, meaning
and default (Megatron-LM's parser at core_v0.19.0: megatron/training/arguments.py and the config
dataclasses it builds groups from; argument_table.py notes where one differs). What we add is the
`--recover*` family. Every Megatron-LM argument has one status (argument_table.py, and the generated
docs/arguments.md): implemented here, refused at start-up with the reason and what to use instead,
or accepted with no effect and named at start-up with the reason. Any other argument is an argparse
error (exit status 2), as in Megatron-LM.

`parse_args` raises `ValueError` for every user mistake it can see, all of them in one message,
one line each. The dataclasses live in `train_config.py`; megatron-core's config objects are built
from them in `mcore_config.py`.
"""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

from megatron_recover.hang import DEFAULT_HANG_TIMEOUT_S
from megatron_recover.megatron.config import argument_table, moe_arguments
from megatron_recover.megatron.adapters import interleaving
from megatron_recover.megatron.config.train_config import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ExitConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    RecoverConfig,
    TrainConfig,
)
from megatron_recover.megatron.data.datasets import split_is_valid
from megatron_recover.megatron.data.tokenizers import ARGUMENTS as TOKENIZER_ARGUMENTS
from megatron_recover.megatron.data.tokenizers import (
    NULL,
    TIKTOKEN,
    TIKTOKEN_PATTERNS,
    TOKENIZER_TYPES,
)
from megatron_recover.megatron.data.tokenizers import flag as tokenizer_flag
from megatron_recover.policy.rampup import GlobalBatches
from megatron_recover.policy.speed import DEFAULT_WINDOW as DEFAULT_STRAGGLER_WINDOW

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
# Megatron-LM's default split for --data-path when --split is absent (it warns and uses it).
LEGACY_DEFAULT_SPLIT = "969, 30, 1"
# --exit-signal takes any signal name, as Megatron-LM's parser does; these two cannot be caught.
UNCATCHABLE_SIGNALS = ("SIGKILL", "SIGSTOP")

# ---------------------------------------------------------------------------------------------
# The parser
# ---------------------------------------------------------------------------------------------


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("network size")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope"])
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"])
    g.add_argument("--kv-channels", type=int)
    g.add_argument("--apply-layernorm-1p", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--attention-backend", default="auto",
                   choices=["flash", "fused", "unfused", "local", "auto"])
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"])
    g.add_argument("--recompute-activations", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full", "selective"])
    g.add_argument("--recompute-method", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--use-cpu-initialization", action="store_true")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--train-iters", type=int)
    # Sample-based training, as in Megatron-LM: the run and its schedule counted in samples.
    g.add_argument("--train-samples", type=int)
    g.add_argument("--lr-decay-samples", type=int)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-wsd-decay-samples", type=int)
    # Megatron-LM core_v0.19.0's step-wise schedule "THRESHOLD:BS ..." (thresholds in tokens).
    g.add_argument("--step-batch-size-schedule")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=LR_DECAY_STYLES)
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-wsd-decay-iters", type=int)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float)
    g.add_argument("--end-weight-decay", type=float)
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"])
    g.add_argument("--decoupled-lr", type=float)
    g.add_argument("--decoupled-min-lr", type=float)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    # On --load, where the scheduler's values come from (Megatron-LM's two spellings of each).
    g.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler",
                   action="store_true", dest="override_opt_param_scheduler")
    g.add_argument("--use-checkpoint-opt-param-scheduler",
                   "--use-checkpoint-opt_param-scheduler", action="store_true",
                   dest="use_checkpoint_opt_param_scheduler")


def _add_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    # The interleaved schedule (virtual pipeline stages), as Megatron-LM names it.
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int)
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int)
    g.add_argument("--no-overlap-p2p-communication", action="store_false",
                   dest="overlap_p2p_comm")
    g.add_argument("--overlap-p2p-communication-warmup-flush", action="store_true")
    g.add_argument("--no-align-param-gather", action="store_false", dest="align_param_gather")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    # None: not given (Megatron's default, 1; under --recover one instance per replica).
    g.add_argument("--num-distributed-optimizer-instances", type=int)
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int)
    # Megatron-LM only has the negative switch (fusion on by default); we add the positive one so
    # a script can ask for it explicitly. Both write one value; None = the device's default.
    g.add_argument("--gradient-accumulation-fusion", action="store_true", default=None)
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                   dest="gradient_accumulation_fusion")
    # Megatron-LM's: the backend of the world and of megatron's own (training) groups.
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default="nccl")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*")
    g.add_argument("--data-args-path")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*")
    g.add_argument("--per-split-data-args-path")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--split")
    g.add_argument("--data-cache-path")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files")
    g.add_argument("--tokenizer-type")
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--tiktoken-pattern")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument("--tokenizer-special-tokens", nargs="+")
    g.add_argument("--null-tokenizer-eod-id", type=int)
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1)


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", "--persistent-save-interval", type=int,
                   dest="save_interval")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist"])
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--pretrained-checkpoint")
    g.add_argument("--ckpt-step", type=int)
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--async-save", action="store_true")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("validation, logging and exit")
    g.add_argument("--eval-interval", type=int)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--tensorboard-dir")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    for flag in ("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard"):
        g.add_argument(flag, action="store_false", dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--wandb-project", default="")
    g.add_argument("--wandb-exp-name", default="")
    g.add_argument("--wandb-save-dir", default="")
    g.add_argument("--wandb-entity", default="")
    g.add_argument("--exit-duration-in-mins", type=float)
    g.add_argument("--exit-interval", type=int)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--exit-signal", default="SIGTERM", choices=[s.name for s in signal.Signals],
                   metavar="SIGNAL")


def _add_recover_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("recovery (megatron-recover)")
    g.add_argument("--recover", action="store_true",
                   help="survive replica failures in-step (launch with mpirun --with-ft ulfm)")
    # Defaults are None so that _recover can tell "given without --recover" from "not given".
    g.add_argument("--recover-policy", choices=["static", "adaptive"],
                   help="static (default): the batch stays B; adaptive: drop-and-go")
    g.add_argument("--recover-mode", choices=["exact", "reserve"],
                   help="exact (default): failure-free microbatch ids; reserve: the paper's")
    g.add_argument("--recover-failure-schedule", metavar="PATH", help="YAML faults to inject")
    g.add_argument("--recover-log", metavar="PATH", help="per-iteration JSONL records")
    g.add_argument("--recover-hang-timeout", type=float, metavar="SECONDS",
                   help="declare a rank that stops answering (frozen) failed after this many "
                        f"seconds (Open MPI's failure detector; default {DEFAULT_HANG_TIMEOUT_S:g}"
                        ", 0: off)")
    g.add_argument("--recover-ranks-per-device", type=int, default=1, metavar="N",
                   help="bind N consecutive node-local ranks to one GPU (default %(default)s, "
                        "Megatron's one rank per GPU); for tests of several one-rank replicas "
                        "on one GPU, with or without --recover")
    g.add_argument("--recover-cuda-aware-mpi", action="store_true",
                   help="hand the cross-replica reductions' CUDA buffers to MPI directly (needs "
                        "an MPI built with CUDA; 16-bit sums are staged all the same); default: "
                        "staged through pinned host memory on side streams")
    g.add_argument("--recover-data-plane", choices=["torch", "mpi"],
                   help="what carries the cross-replica bytes (gradient buckets, state "
                        "transfers): torch (default where torch can reconfigure a process "
                        "group: gloo on CPU, NCCL on CUDA, reconfigured over the survivors) or "
                        "mpi (the ulfm group itself); consensus and membership always run on "
                        "ulfm (docs/data-planes.md)")
    g.add_argument("--cross-replica-backend", choices=["gloo", "ulfm"],
                   help="backend of the data-parallel group: gloo (default) or ulfm (stock "
                        "Megatron data parallelism over the fault-tolerant collective, no "
                        "recovery; launch with mpirun --with-ft ulfm); --recover always uses ulfm")
    g.add_argument("--recover-standby-replicas", type=int, metavar="K",
                   help="start K replicas more than the training ones (mpirun -np counts them, "
                        "as the last ranks): they wait without a busy core and replace lost "
                        "replicas after the iteration that lost them, B unchanged")
    g.add_argument("--recover-snapshot-interval", type=int, metavar="N",
                   help="every N iterations each rank snapshots its complete training state "
                        "into node-local memory (a helper thread writes it); a relaunch after a "
                        "node loss (megatron-recover launch --max-relaunches) resumes from the "
                        "newest snapshot the surviving nodes hold (default 0: none)")
    g.add_argument("--recover-snapshot-dir", metavar="DIR",
                   help="where the snapshots go: a node-local directory, for this job only "
                        "(default under megatron-recover launch: /dev/shm/megatron-recover-"
                        "RUN_ID)")
    g.add_argument("--recover-program-errors", choices=["abort", "survive"],
                   help="abort (default): an error of the program or the data on any rank (not "
                        "a lost peer or a device fault) ends the job with the traceback, the "
                        "iteration and the microbatch id, since it would recur on every replica "
                        "that runs that microbatch; survive: the rank leaves as a failed one and "
                        "the survivors absorb it (docs/failures.md)")
    g.add_argument("--recover-sdc-check-rate", type=float, metavar="P",
                   help="sampled cross-replica verification: each iteration every contributing "
                        "replica's first pass is, with probability P, run a second time by the "
                        "next replica, and the two gradients' fingerprints must agree; a "
                        "mismatch is arbitrated by a third replica and the one that disagrees "
                        "is evicted before the commit, its microbatches redone in-step. Costs "
                        "about P of the compute (default 0: off; exact mode; "
                        "docs/verification.md)")
    g.add_argument("--recover-sdc-tolerance", type=float, metavar="T",
                   help="how far two fingerprints of the same microbatches may differ, relative "
                        "to the larger (default 0: bitwise, which deterministic kernels give; "
                        "kernels that are not deterministic need a measured tolerance)")
    g.add_argument("--recover-nonfinite-rerun", choices=("off", "evict", "keep"),
                   help="what a replica whose gradient fails Megatron's NaN/inf check does: off "
                        "(default): it leaves at once and the others redo its microbatches; "
                        "evict or keep: it holds its gradient out and runs its microbatches "
                        "again while another replica runs them too, before the commit: "
                        "non-finite on both, the data is at fault and the job ends with the "
                        "microbatch ids and samples; on the replica alone, its device is "
                        "evicted; not again, a transient fault, evicted (evict) or its rerun's "
                        "gradient used (keep) (docs/failures.md)")
    g.add_argument("--recover-straggler-threshold", type=float, metavar="F",
                   help="balance work by measured speed: a replica whose first pass takes more "
                        "than 1 + F times the other replicas' median time per microbatch for "
                        "--recover-straggler-window iterations gets fewer microbatches and the "
                        "others more (B unchanged; exact mode still commits the failure-free "
                        "ids), until it is within that bound for a window again (default 0: "
                        "off; docs/stragglers.md)")
    g.add_argument("--recover-straggler-window", type=int, metavar="N",
                   help="consecutive iterations a replica must be slow (or back within the "
                        "threshold) before work moves (or moves back), and past "
                        "--recover-evict-slower-than before it is evicted (default "
                        f"{DEFAULT_STRAGGLER_WINDOW}, at least 2)")
    g.add_argument("--recover-evict-slower-than", type=float, metavar="X",
                   help="evict a replica whose time per microbatch stays more than X times the "
                        "other replicas' median for --recover-straggler-window iterations: it "
                        "leaves as a failed replica (a standby, if any, takes its place) "
                        "(default 0: never)")
    g.add_argument("--recover-no-restore", action="store_true",
                   help="diagnostic: after a failure, re-reduce without rewinding stale buckets "
                        "(shows what gradient restoration buys; breaks the trajectory)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `pretrain_gpt_recover.py` (Megatron-LM names, meanings, defaults)."""
    # allow_abbrev=False as in Megatron-LM: "--recover" must never match "--recover-log".
    parser = argparse.ArgumentParser(prog="pretrain_gpt_recover.py", allow_abbrev=False,
                                     description="Megatron GPT pre-training that survives "
                                     "replica failures (megatron-recover).")
    for add in (_add_model_args, moe_arguments.add_moe_args, _add_training_args,
                _add_precision_args, _add_parallel_args, _add_data_args, _add_checkpoint_args,
                _add_logging_args, _add_recover_args,
                argument_table.add_no_effect_args):
        add(parser)
    return parser


# ---------------------------------------------------------------------------------------------
# Validation: each check returns the problems it sees, as lines that say what to change.
# ---------------------------------------------------------------------------------------------


def _required(ns) -> list[str]:
    missing = [flag for flag in ("--num-layers", "--hidden-size", "--num-attention-heads",
                                 "--seq-length", "--micro-batch-size", "--lr")
               if getattr(ns, flag[2:].replace("-", "_")) is None]
    if ns.train_iters is None and ns.train_samples is None:
        missing.append("--train-iters (or --train-samples)")
    if missing:
        return [f"missing required arguments: pass {', '.join(missing)}"]
    return []


def _positive(ns) -> list[str]:
    problems = []
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--micro-batch-size", "--train-iters", "--train-samples",
                 "--lr-decay-samples", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size", "--num-distributed-optimizer-instances",
                 "--num-layers-per-virtual-pipeline-stage",
                 "--num-virtual-stages-per-pipeline-rank",
                 "--microbatch-group-size-per-virtual-pipeline-stage",
                 "--log-interval", "--global-batch-size", "--ffn-hidden-size",
                 "--max-position-embeddings", "--save-interval", "--lr-decay-iters",
                 "--ddp-bucket-size", "--vocab-size", "--num-query-groups",
                 "--make-vocab-size-divisible-by", "--kv-channels", "--recompute-num-layers",
                 "--tensorboard-log-interval", "--tensorboard-queue-size", "--seed"):
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            problems.append(f"{flag} must be a positive integer, got {value}")
    for flag in ("--hidden-dropout", "--attention-dropout"):
        value = getattr(ns, flag[2:].replace("-", "_"))
        if not 0.0 <= value < 1.0:
            problems.append(f"{flag} must be in [0, 1), got {value}")
    return problems


def _ranks_per_replica(ns, world_size: int) -> int:
    """TP x PP, times the data-parallel ranks of a distributed-optimizer instance."""
    mp = ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size
    if not ns.use_distributed_optimizer:
        return mp
    dp = max(world_size // mp, 1)
    return mp * max(dp // max(_optimizer_instances(ns, dp), 1), 1)


def _device_refusals(ns, world_size: int, cuda_available: bool, te_available: bool,
                     fusion_kernel_available: bool) -> list[str]:
    """Implemented arguments refused on this machine: kernels the device cannot run, layers
    that need Transformer Engine, devices shared by ranks of one NCCL group (argument_table.py
    refuses the others by name)."""
    problems = []
    if not cuda_available and ns.gradient_accumulation_fusion:
        problems.append("--gradient-accumulation-fusion needs a CUDA kernel (Apex's "
                        "fused_weight_gradient_mlp_cuda): drop it (or pass "
                        "--no-gradient-accumulation-fusion)")
    if (cuda_available and ns.gradient_accumulation_fusion is not False
            and not fusion_kernel_available):
        problems.append("gradient accumulation fusion (Megatron's default on CUDA) needs Apex's "
                        "fused_weight_gradient_mlp_cuda kernel, which does not import here: "
                        "add --no-gradient-accumulation-fusion, or install Apex with its CUDA "
                        "extensions")
    plane = data_plane(ns, cuda_available)
    if ns.recover_data_plane == "torch" and not _reconfigure_supported():
        import torch

        problems.append("--recover-data-plane torch needs torch's reconfigurable process groups "
                        f"(torch 2.14 or later; this is {torch.__version__}): use "
                        "--recover-data-plane mpi")
    if (ns.recover_data_plane == "torch" and cuda_available and ns.recover_ranks_per_device > 1):
        problems.append(f"--recover-data-plane torch with --recover-ranks-per-device "
                        f"{ns.recover_ranks_per_device}: the cross-replica NCCL group would put "
                        "two ranks on one GPU, which NCCL refuses: use --recover-data-plane mpi")
    if ns.recover_cuda_aware_mpi and plane == "torch":
        problems.append("--recover-cuda-aware-mpi hands CUDA buffers to MPI on the mpi data "
                        "plane; the torch plane moves them with NCCL: add --recover-data-plane "
                        "mpi or drop it")
    if ns.recover_cuda_aware_mpi and not cuda_available:
        problems.append("--recover-cuda-aware-mpi passes CUDA buffers to MPI, and this machine "
                        "trains on the CPU: drop it")
    if ns.recover_ranks_per_device < 1:
        problems.append(f"--recover-ranks-per-device must be a positive integer, got "
                        f"{ns.recover_ranks_per_device}")
    elif (cuda_available and ns.recover_ranks_per_device > 1
          and ns.distributed_backend == "nccl" and _ranks_per_replica(ns, world_size) > 1):
        problems.append(f"--recover-ranks-per-device {ns.recover_ranks_per_device}: a replica "
                        f"here has {_ranks_per_replica(ns, world_size)} ranks, whose NCCL groups would put "
                        "two ranks on one GPU, which NCCL refuses: share devices only between "
                        "replicas of one rank each (TP = PP = 1, no distributed-optimizer "
                        "shards), or give each rank its own GPU")
    needs_te = [flag for flag, given in (
        ("--transformer-impl transformer_engine", ns.transformer_impl == "transformer_engine"),
        ("--use-flash-attn", ns.use_flash_attn),
        ("--cross-entropy-fusion-impl te", ns.cross_entropy_fusion_impl == "te"))
        if given]
    if needs_te and not te_available:
        problems.append(f"{', '.join(needs_te)}: Transformer Engine does not import here (it "
                        "needs CUDA and the transformer-engine package); use "
                        "--transformer-impl local, megatron-core's own layers, and drop the "
                        "Transformer Engine options")
    elif ns.use_flash_attn and ns.transformer_impl == "local":
        problems.append("--use-flash-attn selects Transformer Engine's flash attention: drop "
                        "--transformer-impl local or drop --use-flash-attn")
    return problems


def _reconfigure_supported() -> bool:
    from megatron_recover.collective.torch_plane import reconfigure_supported

    return reconfigure_supported()


def data_plane(ns, cuda_available: bool) -> str:
    """--recover-data-plane, or its default: torch where torch reconfigures process groups and
    the cross-replica group can be an NCCL one (one rank per GPU, no CUDA-aware MPI asked for),
    else mpi."""
    if ns.recover_data_plane:
        return ns.recover_data_plane
    if not _reconfigure_supported():
        return "mpi"
    if cuda_available and (ns.recover_ranks_per_device > 1 or ns.recover_cuda_aware_mpi):
        return "mpi"
    return "torch"


def _transformer_impl(ns, te_available: bool) -> str:
    """--transformer-impl, or Megatron-LM's default (transformer_engine) where it can run."""
    if ns.transformer_impl is not None:
        return ns.transformer_impl
    return "transformer_engine" if te_available else "local"


def _recompute(ns) -> list[str]:
    """Megatron-LM's and TransformerConfig's rules for activation recomputation."""
    granularity = _recompute_granularity(ns)
    if ns.recompute_activations and ns.recompute_granularity == "full":
        return ["--recompute-activations means --recompute-granularity selective: drop one"]
    if granularity != "full":
        given = [f for f in ("--recompute-method", "--recompute-num-layers")
                 if getattr(ns, f[2:].replace("-", "_")) is not None]
        return [f"{', '.join(given)} apply to --recompute-granularity full"] if given else []
    problems = []
    if ns.recompute_method is None:
        problems.append("--recompute-granularity full needs --recompute-method uniform or block")
    per_stage = ns.num_layers // ns.pipeline_model_parallel_size
    if ns.recompute_num_layers is None or not 1 <= ns.recompute_num_layers <= per_stage:
        problems.append(f"--recompute-granularity full needs --recompute-num-layers between 1 "
                        f"and the {per_stage} layers of a pipeline stage")
    return problems


def _recompute_granularity(ns) -> str | None:
    return "selective" if ns.recompute_activations else ns.recompute_granularity


def _precision(ns) -> list[str]:
    if ns.fp16 and ns.bf16:
        return ["--fp16 and --bf16 were both given: pass one of them (or neither for fp32)"]
    if ns.grad_reduce_in_bf16 and not ns.bf16:
        return ["--grad-reduce-in-bf16 reduces bf16 gradient buffers: it needs --bf16"]
    return []


def _grads_in_fp32(ns) -> bool:
    """Megatron-LM's validate_args: bf16 accumulates and reduces gradients in fp32 unless
    --grad-reduce-in-bf16; fp16 and fp32 only when --accumulate-allreduce-grads-in-fp32."""
    if ns.bf16:
        return not ns.grad_reduce_in_bf16
    return ns.accumulate_allreduce_grads_in_fp32


def _model_shape(ns) -> list[str]:
    problems = []
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    if ns.kv_channels is None and ns.hidden_size % ns.num_attention_heads:
        problems.append(f"--hidden-size {ns.hidden_size} is not divisible by "
                        f"--num-attention-heads {ns.num_attention_heads}: change one so that "
                        "hidden = heads x head size, or pass --kv-channels")
    if ns.num_attention_heads % tp:
        problems.append(f"--num-attention-heads {ns.num_attention_heads} is not divisible by "
                        f"--tensor-model-parallel-size {tp}: each TP rank holds whole heads")
    if ns.group_query_attention and (ns.num_attention_heads % ns.num_query_groups
                                     or ns.num_query_groups % tp):
        problems.append(f"--num-query-groups {ns.num_query_groups} must divide "
                        f"--num-attention-heads {ns.num_attention_heads} and be a multiple of "
                        f"--tensor-model-parallel-size {tp}")
    if ns.num_layers % pp:
        problems.append(f"--num-layers {ns.num_layers} is not divisible by "
                        f"--pipeline-model-parallel-size {pp}: each stage holds the same number "
                        "of layers")
    if ns.position_embedding_type == "learned_absolute" and ns.max_position_embeddings is not None \
            and ns.seq_length > ns.max_position_embeddings:
        problems.append(f"--seq-length {ns.seq_length} exceeds --max-position-embeddings "
                        f"{ns.max_position_embeddings} with learned_absolute position embeddings: "
                        "raise --max-position-embeddings or shorten --seq-length")
    if _ffn_hidden_size(ns) < 1:
        problems.append(f"--swiglu with --hidden-size {ns.hidden_size} gives Megatron's default "
                        "ffn size int(4*h*2/3/64)*64 = 0: pass --ffn-hidden-size")
    return problems


def _sizes(ns, world_size: int) -> tuple[int, int]:
    """(data-parallel size, global batch size): world / (TP x PP), and --global-batch-size or
    Megatron's default, micro-batch size x data-parallel size."""
    dp = world_size // (ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size)
    gbs = ns.global_batch_size if ns.global_batch_size is not None else ns.micro_batch_size * dp
    return dp, gbs


def _parallel_layout(ns, world_size: int) -> list[str]:
    """Divisibility of world, batch and optimizer instances; the distributed-optimizer rule."""
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    if world_size % (tp * pp):
        return [f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                f"--pipeline-model-parallel-size {pp}: launch a multiple of {tp * pp} processes "
                "or change TP/PP"]
    (dp, gbs), mbs = _sizes(ns, world_size), ns.micro_batch_size
    problems = []
    if gbs % (mbs * dp):
        problems.append(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x "
                        f"data-parallel size {dp}: use a multiple of {mbs * dp}")
    k = ns.num_distributed_optimizer_instances
    if k is not None and k > 1 and not ns.use_distributed_optimizer:
        problems.append(f"--num-distributed-optimizer-instances {k} needs "
                        "--use-distributed-optimizer: add it or drop the instances")
    elif k is not None and dp % k:
        problems.append(f"data-parallel size {dp} is not divisible by "
                        f"--num-distributed-optimizer-instances {k}: use a divisor of {dp}")
    elif ns.recover and ns.use_distributed_optimizer and k == 1 and dp > 1:
        problems.append("--use-distributed-optimizer --num-distributed-optimizer-instances 1 with "
                        "--recover shards optimizer state across replicas, and a dead replica "
                        "would take its shard with it: pass --num-distributed-optimizer-instances "
                        f"K, a divisor of {dp} (K replicas, each sharded over {dp}/K ranks), or "
                        "leave it out (one instance per replica)")
    if ns.overlap_param_gather and not ns.use_distributed_optimizer:
        problems.append("--overlap-param-gather only works with the distributed optimizer (as in "
                        "Megatron-LM): add --use-distributed-optimizer or drop it")
    if ns.overlap_param_gather and not ns.overlap_grad_reduce:
        problems.append("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM): "
                        "add it or drop --overlap-param-gather")
    return problems


def virtual_stages(ns) -> int | None:
    """The model chunks per pipeline rank of the interleaved schedule (Megatron-LM's
    virtual_pipeline_model_parallel_size), or None for the plain 1F1B schedule, which one
    virtual stage per rank is (as Megatron-LM treats it)."""
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = ns.num_layers // ns.pipeline_model_parallel_size
        stages = per_stage // ns.num_layers_per_virtual_pipeline_stage
    else:
        stages = ns.num_virtual_stages_per_pipeline_rank
    return None if stages == 1 else stages


def _interleaved_only(ns, instead: str) -> list[str]:
    """The flags given that only the interleaved schedule reads, refused with `instead`."""
    return [f"{flag} applies to the interleaved schedule: {instead}"
            for flag, value in (("--microbatch-group-size-per-virtual-pipeline-stage",
                                 ns.microbatch_group_size_per_virtual_pipeline_stage),
                                ("--overlap-p2p-communication-warmup-flush",
                                 ns.overlap_p2p_communication_warmup_flush))
            if value]


def _virtual_pipeline(ns, world_size: int) -> list[str]:
    """Megatron-LM's rules for virtual pipeline stages, and megatron-core's interleaved
    schedule's for the microbatches of a full pass (every global batch of a batch-size
    schedule)."""
    per_vstage = ns.num_layers_per_virtual_pipeline_stage
    given = [f for f in ("--num-layers-per-virtual-pipeline-stage",
                         "--num-virtual-stages-per-pipeline-rank")
             if getattr(ns, f[2:].replace("-", "_")) is not None]
    pp = ns.pipeline_model_parallel_size
    if not given:
        return _interleaved_only(ns, "add --num-virtual-stages-per-pipeline-rank or drop it")
    if ns.overlap_p2p_communication_warmup_flush and not ns.overlap_p2p_comm:
        return ["--overlap-p2p-communication-warmup-flush overlaps the pipeline's sends and "
                "receives, which --no-overlap-p2p-communication batches instead: drop one"]
    if len(given) == 2:
        return ["--num-layers-per-virtual-pipeline-stage and "
                "--num-virtual-stages-per-pipeline-rank are mutually exclusive: keep one"]
    if pp == 1:
        return [f"{given[0]} needs pipeline parallelism (the interleaved schedule splits each "
                "pipeline rank's layers into model chunks): add --pipeline-model-parallel-size "
                "2 or more, or drop it"]
    per_stage = ns.num_layers // pp
    if per_vstage is not None and per_stage % per_vstage:
        return [f"number of layers per pipeline stage ({per_stage}) must be divisible by "
                f"--num-layers-per-virtual-pipeline-stage {per_vstage}: use a divisor of "
                f"{per_stage}"]
    chunks = virtual_stages(ns)
    if chunks is None:  # one virtual stage per rank: the plain 1F1B schedule
        return _interleaved_only(ns, f"{given[0]} gives each pipeline rank one virtual stage "
                                     "(the plain schedule): drop it")
    if pp == 2 and not ns.overlap_p2p_comm:
        return ["--no-overlap-p2p-communication with --pipeline-model-parallel-size 2 and "
                "virtual stages: each stage is then both the other's previous and next stage, "
                "and megatron-core's batched sends and receives (0.16.1 and 0.19.0) pair a "
                "forward activation with a backward gradient (measured: the first iteration's loss "
                "changes with the data-parallel size); drop --no-overlap-p2p-communication "
                "(Megatron-LM's default overlaps them) or use more pipeline stages"]
    if ns.num_layers % (pp * chunks):
        return [f"--num-layers {ns.num_layers} does not split into {pp} pipeline stages x "
                f"{chunks} virtual stages of equal size: use a multiple of {pp * chunks} layers"]
    group = ns.microbatch_group_size_per_virtual_pipeline_stage or pp
    dp, mbs = _sizes(ns, world_size)[0], ns.micro_batch_size
    for size in _global_batches(ns, world_size).sizes:
        problem = interleaving.problem(size // (mbs * dp), group, pp)
        if problem:
            return [f"the interleaved schedule refuses a global batch of {size} samples "
                    f"({size // (mbs * dp)} micro-batches per data-parallel rank): {problem}; "
                    "choose --global-batch-size (or every size of --step-batch-size-schedule) "
                    f"so that every data-parallel rank runs a multiple of {group} micro-batches, "
                    "or set --microbatch-group-size-per-virtual-pipeline-stage"]
    return []


def _optimizer_instances(ns, dp: int) -> int:
    """--num-distributed-optimizer-instances, or, when it is not given, Megatron's 1 — except
    that --recover with --use-distributed-optimizer makes each replica an instance, since state
    sharded across replicas would die with one of them: the smallest replica that holds an
    expert-parallel group, so DP / E instances of E data-parallel ranks (every data-parallel
    rank its own instance without expert parallelism)."""
    if ns.num_distributed_optimizer_instances is not None:
        return ns.num_distributed_optimizer_instances
    if not (ns.recover and ns.use_distributed_optimizer):
        return 1
    return dp // ns.expert_model_parallel_size


_SAMPLE_FLAGS = ("--lr-decay-samples", "--lr-warmup-samples", "--lr-wsd-decay-samples")
_ITERATION_FLAGS = ("--lr-decay-iters", "--lr-warmup-iters", "--lr-wsd-decay-iters")


def _given(ns, flag: str) -> bool:
    value = getattr(ns, flag[2:].replace("-", "_"))
    return value is not None and not (flag.startswith("--lr-warmup-") and value == 0)


def _unit(ns, world_size: int) -> list[str]:
    """Megatron-LM's rule: a run is iteration-based (--train-iters) or sample-based
    (--train-samples), and its learning-rate schedule is given in the same unit."""
    if (ns.train_iters is None) == (ns.train_samples is None):
        return ["give exactly one of --train-iters (iteration-based) and --train-samples "
                "(sample-based)"]
    wrong = [f for f in (_SAMPLE_FLAGS if ns.train_iters is not None else _ITERATION_FLAGS)
             if _given(ns, f)]
    if wrong:
        unit = "iteration" if ns.train_iters is not None else "sample"
        flags = _ITERATION_FLAGS if unit == "iteration" else _SAMPLE_FLAGS
        return [f"{', '.join(wrong)} with {unit}-based training: give the schedule in "
                f"{unit}s ({', '.join(flags)})"]
    gbs = _sizes(ns, world_size)[1]
    # With a batch-size schedule Megatron-LM trains every iteration that starts before
    # --train-samples are consumed, so any positive count trains one.
    if ns.train_samples is not None and ns.train_samples < gbs \
            and ns.step_batch_size_schedule is None:
        return [f"--train-samples {ns.train_samples} is less than one global batch ({gbs} "
                "samples): train for at least one"]
    return []


def _global_batches(ns, world_size: int) -> GlobalBatches:
    """The global batch of every iteration: --step-batch-size-schedule's (thresholds in tokens
    of --seq-length, as Megatron-LM passes them), or the global batch size in every one."""
    if ns.step_batch_size_schedule is None:
        return GlobalBatches.of(_sizes(ns, world_size)[1])
    return GlobalBatches.of_schedule(ns.step_batch_size_schedule, ns.seq_length)


def _step_schedule(ns, world_size: int) -> list[str]:
    """--step-batch-size-schedule: Megatron-LM core_v0.19.0's refusals (with --global-batch-size;
    megatron-core's parsing and validation), its assertion that each global batch the run
    reaches divides by micro-batch x data-parallel size, here at start-up; and what the policy
    needs: sample-based training, sizes that never decrease."""
    schedule = ns.step_batch_size_schedule
    if schedule is None:
        return []
    if ns.global_batch_size is not None:
        return ["Cannot specify both --step-batch-size-schedule and --global-batch-size (as "
                "Megatron-LM refuses them): drop --global-batch-size, the schedule gives each "
                "iteration's global batch size"]
    if ns.train_iters is not None:
        return ["--step-batch-size-schedule with --train-iters: Megatron-LM core_v0.19.0 counts "
                "an iteration-based run's learning-rate schedule and training split in "
                "iterations x micro-batch x data-parallel size samples (its --global-batch-size "
                "default) while the schedule's iterations consume more, so its learning rate "
                "decays early and its split runs short; give --train-samples and the "
                "learning-rate schedule in samples"]
    try:
        batches = GlobalBatches.of_schedule(schedule, ns.seq_length)
    except ValueError as error:
        return [f"--step-batch-size-schedule {schedule!r}: {error}"]
    dp = _sizes(ns, world_size)[0]
    unit = ns.micro_batch_size * dp
    uneven = [size for size in batches.sizes if size % unit]
    if uneven:
        return [f"--step-batch-size-schedule: the global batch sizes {uneven} are not divisible "
                f"by --micro-batch-size {ns.micro_batch_size} x data-parallel size {dp} "
                "(megatron-core asserts it at the iteration that reaches them; here every "
                "step an iteration starts in counts, beyond --train-samples too, as the policy "
                f"lays the schedule out whole): use multiples of {unit}"]
    return []


def _schedule(ns, world_size: int) -> list[str]:
    problems = _unit(ns, world_size)
    if problems:
        return problems
    problems = _step_schedule(ns, world_size)
    if problems:
        return problems
    sample_based = ns.train_samples is not None
    unit, flag = ("samples", "samples") if sample_based else ("iterations", "iters")
    total = ns.train_samples if sample_based else ns.train_iters
    decay = ns.lr_decay_samples if sample_based else ns.lr_decay_iters
    warmup_given = ns.lr_warmup_samples if sample_based else ns.lr_warmup_iters
    if ns.lr_warmup_fraction is not None and warmup_given:
        problems.append(f"--lr-warmup-{flag} and --lr-warmup-fraction were both given: keep one")
    if ns.min_lr > ns.lr:
        problems.append(f"--min-lr {ns.min_lr} exceeds --lr {ns.lr}: lower --min-lr")
    if ns.lr_warmup_init > ns.lr:
        problems.append(f"--lr-warmup-init {ns.lr_warmup_init} exceeds --lr {ns.lr}")
    decay = decay if decay is not None else total
    warmup = (ns.lr_warmup_fraction * decay if ns.lr_warmup_fraction is not None
              else warmup_given or 0)
    if not 0 <= warmup < decay:
        problems.append(f"warmup of {warmup:g} {unit} must be shorter than the {decay} decay "
                        f"{unit} (--lr-decay-{flag}, default --train-{flag}): shorten the "
                        "warmup or lengthen the decay")
    wsd = ns.lr_wsd_decay_samples if sample_based else ns.lr_wsd_decay_iters
    if ns.lr_decay_style == "WSD" and wsd is None:
        problems.append(f"--lr-decay-style WSD needs --lr-wsd-decay-{flag} (its annealing phase)")
    return problems


def _weight_decay_and_decoupled_lr(ns) -> list[str]:
    """Megatron-LM's rules: a constant weight decay is --weight-decay; an increasing one names
    its ends. The decoupled rates apply to the embedding and output layer."""
    problems = []
    ends = [f for f in ("--start-weight-decay", "--end-weight-decay")
            if getattr(ns, f[2:].replace("-", "_")) is not None]
    if ns.weight_decay_incr_style == "constant" and ends:
        problems.append(f"{', '.join(ends)} need --weight-decay-incr-style linear or cosine "
                        "(a constant weight decay is --weight-decay)")
    elif ns.weight_decay_incr_style != "constant" and len(ends) < 2:
        problems.append(f"--weight-decay-incr-style {ns.weight_decay_incr_style} needs "
                        "--start-weight-decay and --end-weight-decay")
    if ns.decoupled_min_lr is not None and ns.decoupled_lr is None:
        problems.append("--decoupled-min-lr is the floor of --decoupled-lr: add --decoupled-lr")
    elif ns.decoupled_lr is not None and ns.decoupled_min_lr is None and ns.decoupled_lr < 0:
        problems.append(f"--decoupled-lr must be >= 0, got {ns.decoupled_lr:g}")
    elif ns.decoupled_lr is not None and ns.decoupled_lr < ns.decoupled_min_lr:
        problems.append(f"--decoupled-min-lr {ns.decoupled_min_lr:g} exceeds --decoupled-lr "
                        f"{ns.decoupled_lr:g}")
    if ns.override_opt_param_scheduler and ns.use_checkpoint_opt_param_scheduler:
        problems.append("--override-opt-param-scheduler (the arguments win on --load) and "
                        "--use-checkpoint-opt-param-scheduler (the checkpoint wins) contradict "
                        "each other: pass one")
    return problems


_PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def _data(ns) -> list[str]:
    per_split = [f for f in _PER_SPLIT_FLAGS if getattr(ns, f[2:].replace("-", "_")) is not None]
    given = [flag for flag, value in (("--data-path", ns.data_path),
                                      ("--data-args-path", ns.data_args_path),
                                      (" ".join(per_split), per_split or None),
                                      ("--per-split-data-args-path", ns.per_split_data_args_path),
                                      ("--mock-data", ns.mock_data or None)) if value is not None]
    if len(given) > 1:
        return [f"{' and '.join(given)} were both given: pass one of them"]
    if not given:
        return ["no training data: pass --data-path PREFIX (an indexed .bin/.idx dataset from "
                "scripts/preprocess_data.py; or a blend, W1 PREFIX1 W2 PREFIX2 ...), "
                "--data-args-path FILE, --train-data-path (with --valid-data-path and "
                "--test-data-path), --per-split-data-args-path FILE or --mock-data"]
    _, per_split_blends, problems = _data_blends(ns)
    if per_split_blends is not None and ns.split is not None:
        problems.append(f"--split {ns.split} cuts a --data-path blend; with per-split data "
                        "each split's blend is used whole: drop --split")
    if ns.split is not None:
        problems += _split(ns.split)
    return problems


def _data_blends(ns) -> tuple[tuple | None, tuple | None, list[str]]:
    """(megatron's blend, its blend_per_split, problem lines) of the data flags, one source of
    them given: --data-path or --data-args-path give the blend, the per-split flags the
    (train, valid, test) blends; both None with --mock-data."""
    for flag in ("--data-args-path", "--per-split-data-args-path"):
        path = getattr(ns, flag[2:].replace("-", "_"))
        if path is not None and not Path(path).is_file():
            return None, None, [f"{flag} {path}: no such file"]
    if ns.per_split_data_args_path is None and all(
            getattr(ns, f[2:].replace("-", "_")) is None for f in _PER_SPLIT_FLAGS):
        words = (Path(ns.data_args_path).read_text().split() if ns.data_args_path is not None
                 else ns.data_path)  # the file's words as Megatron-LM reads them
        blend, problems = _blend(words)
        return blend, None, problems
    words, problem = _per_split_words(ns)
    if problem:
        return None, None, [problem]
    blends, problems = zip(*map(_blend, words))
    problems = [line for lines in problems for line in lines]
    if words[0] is None:
        problems.append("per-split data without a training blend: pass --train-data-path "
                        "(or a \"train\" entry in --per-split-data-args-path)")
    return None, tuple(blends), problems


def _per_split_words(ns) -> tuple[list, str | None]:
    """The train, valid and test words of the per-split paths, or of
    --per-split-data-args-path's JSON file (an entry a string or a list, as Megatron-LM reads
    it); each None where not given. Then a problem line, or None."""
    if ns.per_split_data_args_path is None:
        return [getattr(ns, f[2:].replace("-", "_")) for f in _PER_SPLIT_FLAGS], None
    path = ns.per_split_data_args_path
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        return [None] * 3, f"--per-split-data-args-path {path}: {error}"
    if not isinstance(entries, dict) or not all(
            isinstance(entries.get(split), (str, list, type(None)))
            for split in ("train", "valid", "test")):
        return [None] * 3, (f"--per-split-data-args-path {path}: a JSON object with \"train\", "
                            "\"valid\" and \"test\", each a blend's words as a string or a list")
    words = [entries.get(split) for split in ("train", "valid", "test")]
    return [w.split() if isinstance(w, str) else w for w in words], None


def _blend(words: list[str] | None) -> tuple[tuple | None, list[str]]:
    """(megatron's blend of the --data-path words, problem lines). The blend is what
    megatron-core's get_blend_from_list makes of them (all prefixes, or weight-prefix pairs);
    the checks come first, since it only asserts on a mixed list."""
    if words is None:
        return None, []
    if not words:
        return None, ["--data-path needs a dataset prefix (or W1 PREFIX1 W2 PREFIX2 ...)"]
    weighted = len(words) % 2 == 0 and all(_is_number(w) for w in words[0::2])
    numbers = [w for i, w in enumerate(words) if _is_number(w) and not (weighted and i % 2 == 0)]
    if numbers:
        return None, [f"--data-path {' '.join(words)}: {', '.join(numbers)} in the place of a "
                      "prefix; a blend is either prefixes only or weight-prefix pairs "
                      "(W1 PREFIX1 W2 PREFIX2 ...)"]
    if weighted:
        weights = [float(w) for w in words[0::2]]
        if min(weights) < 0 or sum(weights) <= 0:
            return None, [f"--data-path {' '.join(words)}: the weights must be >= 0 and not all "
                          "0"]
    from megatron.core.datasets.utils import get_blend_from_list

    prefixes, weights = get_blend_from_list(words)
    problems = [problem for prefix in prefixes for problem in _dataset_files(prefix)]
    blend = (tuple(prefixes), None if weights is None else tuple(weights))
    return (None if problems else blend), problems


def _dataset_files(prefix: str) -> list[str]:
    missing = [p for p in (f"{prefix}.bin", f"{prefix}.idx") if not Path(p).is_file()]
    if not missing:
        return []
    hint = ""
    if prefix.endswith((".bin", ".idx")):
        hint = f"; pass the prefix without the suffix: --data-path {prefix[:-4]}"
    return [f"--data-path {prefix}: {', '.join(missing)} not found{hint}"]


def _split(split: str) -> list[str]:
    if not split_is_valid(split):
        return [f"--split {split!r}: give up to three non-negative proportions "
                "train,valid,test with a positive train share, e.g. --split 969,30,1"]
    return []


def _tokenizer(ns) -> list[str]:
    kind = _tokenizer_type(ns)
    if kind is None:
        return ["no tokenizer: pass --tokenizer-type GPT2BPETokenizer with --vocab-file and "
                "--merge-file, HuggingFaceTokenizer, SentencePieceTokenizer, "
                "GPTSentencePieceTokenizer, Llama2Tokenizer or TikTokenizer with "
                "--tokenizer-model, or NullTokenizer with --vocab-size"]
    if kind not in TOKENIZER_TYPES:
        return [f"--tokenizer-type {kind} is not supported: use one of "
                f"{', '.join(TOKENIZER_TYPES)} (they load offline from local files)"]
    # What each type reads is tokenizer.py's table (its names are the flags' dests).
    required, optional = TOKENIZER_ARGUMENTS[kind]
    problems = []
    for name in _TOKENIZER_FILES:
        path = getattr(ns, name)
        if name in required and path is None:
            problems.append(f"--tokenizer-type {kind} needs {tokenizer_flag(name)}")
        elif name in required and not Path(path).exists():
            problems.append(f"{tokenizer_flag(name)} {path}: no such file or directory")
        elif name not in required and path is not None:
            problems.append(f"{tokenizer_flag(name)}: --tokenizer-type {kind} does not read it: "
                            "drop it, or pass the tokenizer type that does")
    if "vocab_size" in required and ns.vocab_size is None:
        problems.append(f"--tokenizer-type {kind} needs --vocab-size")
    if "vocab_size" not in required + optional and ns.vocab_size is not None:
        problems.append(f"--vocab-size: --tokenizer-type {kind} takes its vocabulary from its "
                        "files: drop it")
    if kind == TIKTOKEN:
        # Absent: v2, as Megatron-LM core_v0.19.0 (megatron-core's tiktoken default).
        if ns.tiktoken_pattern not in (None, *TIKTOKEN_PATTERNS):
            problems.append(f"--tiktoken-pattern must be v1 or v2 (got {ns.tiktoken_pattern!r})")
        if ns.tiktoken_num_special_tokens < 0:
            problems.append("--tiktoken-num-special-tokens must be >= 0")
    eod = ns.null_tokenizer_eod_id
    if kind == NULL and eod is not None and ns.vocab_size is not None and not (
            0 <= eod < ns.vocab_size):
        # Megatron-LM does not check it: an id outside the vocabulary has no embedding row.
        problems.append(f"--null-tokenizer-eod-id {eod}: must be an id of the vocabulary, "
                        f"0..{ns.vocab_size - 1} (--vocab-size {ns.vocab_size})")
    if "tokenizer_special_tokens" not in optional and _special_tokens(ns) is not None:
        problems.append(f"--tokenizer-special-tokens: only TikTokenizer takes a special-token "
                        f"list here (--tokenizer-type {kind} has its own): drop it")
    return problems


# The tokenizer arguments that name files (the others are sizes, a pattern, a token list).
_TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model")


def _special_tokens(ns) -> list[str] | None:
    """--tokenizer-special-tokens."""
    return ns.tokenizer_special_tokens


def _checkpointing(ns) -> list[str]:
    problems = []
    if ns.save is not None and ns.save_interval is None:
        problems.append("--save needs --save-interval (iterations between checkpoints), as in "
                        "Megatron-LM")
    if ns.ckpt_step is not None and ns.ckpt_step < 1:
        problems.append(f"--ckpt-step must name a saved iteration (1 or more), got "
                        f"{ns.ckpt_step}")
    if ns.exit_on_missing_checkpoint and ns.load is None:
        problems.append("--exit-on-missing-checkpoint applies to --load, which is not given: "
                        "add --load DIR or drop it")
    # (--no-load-optim and --no-load-rng without a load are said at start-up: _notices.)
    loads = [flag for flag, given in (
        ("--finetune", ns.finetune), ("--ckpt-step", ns.ckpt_step is not None)) if given]
    if loads and ns.load is None and ns.pretrained_checkpoint is None:
        problems.append(f"{', '.join(loads)} says what to load, and nothing is loaded: add "
                        "--load DIR (or --pretrained-checkpoint DIR) or drop it")
    if ns.async_save and ns.ckpt_format == "torch":
        problems.append("--async-save writes megatron-core distributed checkpoints in the "
                        "background, as in Megatron-LM: pass --ckpt-format torch_dist (the "
                        "default) or drop --async-save")
    if not ns.recover and ns.ckpt_format == "torch":
        problems.append("--ckpt-format torch: runs without --recover save megatron-core "
                        "distributed checkpoints: pass --ckpt-format torch_dist or drop the flag")
    return problems


def _logging(ns, wandb_available: bool) -> list[str]:
    problems = []
    if ns.eval_iters < 0:
        problems.append(f"--eval-iters must be >= 0 (0: no evaluation), got {ns.eval_iters}")
    for flag in ("--eval-interval", "--exit-interval", "--exit-duration-in-mins"):
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value is not None and value < 0:
            problems.append(f"{flag} must be >= 0 (0: off), got {value:g}")
    if ns.exit_signal_handler and ns.exit_signal in UNCATCHABLE_SIGNALS:
        problems.append(f"--exit-signal {ns.exit_signal}: no process can catch it: pass one "
                        "that can be caught, such as SIGTERM (the default) or SIGUSR1")
    if ns.wandb_project and not wandb_available:
        problems.append(f"--wandb-project {ns.wandb_project}: the wandb package is not "
                        "installed here: install it (pip install wandb) or drop the flag "
                        "(--tensorboard-dir logs the same values)")
    return problems


def _recover(ns) -> list[str]:
    given = [flag for flag in ("--recover-policy", "--recover-mode", "--recover-failure-schedule",
                               "--recover-log", "--recover-hang-timeout",
                               "--recover-standby-replicas", "--recover-snapshot-interval",
                               "--recover-snapshot-dir", "--recover-program-errors",
                               "--recover-sdc-check-rate", "--recover-sdc-tolerance",
                               "--recover-nonfinite-rerun", "--recover-straggler-threshold",
                               "--recover-straggler-window", "--recover-evict-slower-than",
                               "--recover-data-plane")
             if getattr(ns, flag[2:].replace("-", "_")) is not None]
    given += [flag for flag in ("--recover-no-restore", "--recover-cuda-aware-mpi")
              if getattr(ns, flag[2:].replace("-", "_"))]
    if given and not ns.recover:
        return [f"{', '.join(given)} given without --recover: add --recover or drop them"]
    problems = []
    if ns.recover and ns.cross_replica_backend == "gloo":
        problems.append("--recover reduces across replicas on ulfm: drop --cross-replica-backend")
    if ns.recover_mode == "reserve" and ns.recover_policy == "adaptive":
        problems.append("--recover-mode reserve applies to the static policy only (the adaptive "
                        "policy has no spares): drop --recover-mode or use --recover-policy static")
    schedule = ns.recover_failure_schedule
    if schedule is not None and not Path(schedule).is_file():
        problems.append(f"--recover-failure-schedule {schedule}: no such file")
    if ns.recover_hang_timeout is not None and ns.recover_hang_timeout < 0:
        problems.append(f"--recover-hang-timeout must be seconds >= 0 (0: no hang detection), "
                        f"got {ns.recover_hang_timeout}")
    if ns.recover_standby_replicas is not None and ns.recover_standby_replicas < 0:
        problems.append(f"--recover-standby-replicas must be >= 0, got "
                        f"{ns.recover_standby_replicas}")
    problems += _snapshots(ns)
    problems += _stragglers(ns)
    if ns.recover and ns.recover_nonfinite_rerun not in (None, "off") and not _checks_for_nan(ns):
        problems.append(f"--recover-nonfinite-rerun {ns.recover_nonfinite_rerun} classifies what "
                        "Megatron's NaN/inf check finds, and this job does not check ("
                        + ("fp16 with dynamic loss scaling leaves non-finite gradients to the "
                           "loss scaler" if ns.check_for_nan_in_loss_and_grad else
                           "--no-check-for-nan-in-loss-and-grad")
                        + "): drop --recover-nonfinite-rerun")
    return problems


def _stragglers(ns) -> list[str]:
    """--recover-straggler-threshold, --recover-straggler-window, --recover-evict-slower-than."""
    from megatron_recover.policy.speed import StragglerConfig

    threshold, window = ns.recover_straggler_threshold, ns.recover_straggler_window
    evict = ns.recover_evict_slower_than
    if threshold is None and window is None and evict is None:
        return []
    if window is not None and not threshold and not evict:
        return ["--recover-straggler-window without --recover-straggler-threshold or "
                "--recover-evict-slower-than has no effect: add one or drop it"]
    if ns.recover_policy == "adaptive":
        return ["--recover-straggler-threshold and --recover-evict-slower-than move work "
                "between the static policy's replicas (drop-and-go gives each the same slice): "
                "drop them or use --recover-policy static"]
    try:
        StragglerConfig(threshold or 0.0, _or(window, DEFAULT_STRAGGLER_WINDOW), evict or 0.0)
    except ValueError as error:
        return [f"--recover-straggler-threshold {threshold or 0:g}, --recover-straggler-window "
                f"{_or(window, DEFAULT_STRAGGLER_WINDOW)}, --recover-evict-slower-than "
                f"{evict or 0:g}: {error}"]
    return []


def _verification(ns, world_size: int) -> list[str]:
    """--recover-sdc-check-rate and --recover-sdc-tolerance (after the layout checks)."""
    rate, tolerance = ns.recover_sdc_check_rate, ns.recover_sdc_tolerance
    if rate is None:
        return (["--recover-sdc-tolerance without --recover-sdc-check-rate: add the rate or "
                 "drop the tolerance"] if tolerance is not None else [])
    problems = []
    if not 0.0 <= rate <= 1.0:
        problems.append(f"--recover-sdc-check-rate is a probability in [0, 1], got {rate}")
    if tolerance is not None and not tolerance >= 0.0:
        problems.append(f"--recover-sdc-tolerance must be >= 0 (0: bitwise), got {tolerance}")
    if ns.recover_mode == "reserve":
        problems.append("--recover-sdc-check-rate compares two replicas' gradients of the same "
                        "microbatch ids, which are equal only in exact mode (each microbatch "
                        "draws its dropout from its id): drop --recover-mode reserve")
    dp = _sizes(ns, world_size)[0]
    replicas = _optimizer_instances(ns, dp) if ns.use_distributed_optimizer else dp
    if rate > 0 and replicas < 2:
        problems.append(f"--recover-sdc-check-rate needs a second replica to run a replica's "
                        f"microbatches again (and a third to tell which of two disagreeing ones "
                        f"is wrong); this job has {replicas}: drop the flag or add replicas")
    return problems


def _snapshots(ns) -> list[str]:
    interval = ns.recover_snapshot_interval
    if interval is None:
        return (["--recover-snapshot-dir without --recover-snapshot-interval: add the interval "
                 "or drop the directory"] if ns.recover_snapshot_dir else [])
    if interval < 0:
        return [f"--recover-snapshot-interval must be >= 0 (0: no snapshots), got {interval}"]
    if interval and ns.recover_standby_replicas:
        return ["--recover-snapshot-interval with --recover-standby-replicas is not supported "
                "yet (a relaunch would have to re-form the standby pool): use one of them"]
    if interval and ns.recover_snapshot_dir is None and ns.snapshot_run_id is None:
        return ["--recover-snapshot-interval needs --recover-snapshot-dir DIR (node-local "
                "storage for this job, e.g. /dev/shm/JOB) when the job is not started by "
                "megatron-recover launch, which names one per job"]
    return []


def _snapshot_dir(ns) -> Path | None:
    from megatron_recover.launch import default_snapshot_dir

    if not ns.recover_snapshot_interval:
        return None
    if ns.recover_snapshot_dir is not None:
        return Path(ns.recover_snapshot_dir)
    return default_snapshot_dir(ns.snapshot_run_id)


def training_world_size(argv: list[str], world_size: int) -> int:
    """The MPI ranks that train: all of them but the --recover-standby-replicas K standby
    replicas (the last ranks). A standby replica has a training replica's shape: TP x PP ranks
    or, with distributed-optimizer instances, one instance of TP x PP x S ranks (S = the
    data-parallel ranks per instance), so the launch holds (instances + K) x TP x PP x S.
    Without an instance count, expert parallelism E makes S = E (`_optimizer_instances`).
    Read before the full parse, which validates the same values; a malformed value leaves the
    world as it is for the full parse to report. Raises ValueError for a launch that cannot be
    cut into instances and standby instances of the same size."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--recover-standby-replicas", type=int, default=0)
    pre.add_argument("--tensor-model-parallel-size", type=int, default=1)
    pre.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    pre.add_argument("--use-distributed-optimizer", action="store_true")
    pre.add_argument("--num-distributed-optimizer-instances", type=int)
    pre.add_argument("--expert-model-parallel-size", type=int, default=1)
    try:
        ns, _ = pre.parse_known_args(argv)
    except SystemExit:
        return world_size
    k = max(ns.recover_standby_replicas or 0, 0)
    m = ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size
    instances = ns.num_distributed_optimizer_instances
    if m < 1:
        return world_size
    ep = ns.expert_model_parallel_size
    if k and ns.use_distributed_optimizer and instances is None and ep > 1:
        if world_size % (ep * m):
            raise ValueError(
                f"{world_size} ranks cannot be cut into replicas of one expert-parallel group "
                f"(--expert-model-parallel-size {ep} x TP x PP = {ep * m} ranks) with "
                f"--recover-standby-replicas {k}: launch a multiple of {ep * m} ranks")
        return world_size - k * ep * m
    if not (k and ns.use_distributed_optimizer and instances and instances > 0):
        # One data-parallel rank per replica (without instances, --recover makes every
        # data-parallel rank its own instance).
        return world_size - k * m
    if world_size % ((instances + k) * m):
        raise ValueError(
            f"{world_size} ranks cannot hold --num-distributed-optimizer-instances {instances} "
            f"and --recover-standby-replicas {k} standby instances of the same size: launch "
            f"(instances + standbys) x TP x PP x S ranks, a multiple of {(instances + k) * m} "
            f"(S: the data-parallel ranks of one instance)")
    return world_size // (instances + k) * instances


def _validate(ns, world_size: int, cuda_available: bool, te_available: bool,
              refused: list[str], wandb_available: bool = False,
              fusion_kernel_available: bool = False,
              grouped_gemm_available: bool = False) -> None:
    """Raise one ValueError listing every problem found (`refused`: the refused flags' lines
    first), or return."""
    problems = _required(ns)
    if not problems:  # the shape checks below read the required values
        problems = _positive(ns)
    if not problems:
        problems = (_model_shape(ns) + _parallel_layout(ns, world_size)
                    + _schedule(ns, world_size) + _recompute(ns))
        if not problems:
            problems = _virtual_pipeline(ns, world_size) + moe_arguments.problems(ns, world_size)
        if ns.recover:
            problems += _verification(ns, world_size)
    problems += (_device_refusals(ns, world_size, cuda_available, te_available,
                                 fusion_kernel_available)
                 + moe_arguments.device_problems(ns, cuda_available, te_available,
                                                 grouped_gemm_available,
                                                 _transformer_impl(ns, te_available))
                 + _precision(ns)
                 + _weight_decay_and_decoupled_lr(ns) + _data(ns) + _tokenizer(ns)
                 + _checkpointing(ns) + _logging(ns, wandb_available) + _recover(ns))
    problems = refused + problems
    if problems:
        raise ValueError("pretrain_gpt_recover.py: invalid arguments:\n  "
                         + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# Building the TrainConfig
# ---------------------------------------------------------------------------------------------


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _ffn_hidden_size(ns) -> int:
    if ns.ffn_hidden_size is not None:
        return ns.ffn_hidden_size
    if ns.swiglu:
        return int((4 * ns.hidden_size * 2 / 3) / 64) * 64
    return 4 * ns.hidden_size


def _checks_for_nan(ns) -> bool:
    """Megatron-LM's rule: on unless turned off, or fp16 scales the loss dynamically."""
    return ns.check_for_nan_in_loss_and_grad and not (ns.fp16 and not ns.loss_scale)


def _tokenizer_type(ns) -> str | None:
    if ns.tokenizer_type is not None:
        return ns.tokenizer_type
    if ns.vocab_file is not None and ns.merge_file is not None:
        return "GPT2BPETokenizer"
    if ns.vocab_size is not None and ns.tokenizer_model is None:
        return "NullTokenizer"
    return None


def _notices(ns, argv: list[str], world_size: int, cuda_available: bool,
             te_available: bool) -> tuple[str, ...]:
    """The start-up lines about the arguments: choices made for the user, then the no-effect
    flags given, one line per reason."""
    lines = []
    impl = _transformer_impl(ns, te_available)
    if ns.transformer_impl is None:
        why = ("Transformer Engine imports here" if te_available else
               "megatron-core's own layers, since Transformer Engine does not import here")
        lines.append(f"megatron-recover: --transformer-impl not given: {impl} ({why}; "
                     "Megatron-LM's default is transformer_engine)")
    if impl == "local" and ns.attention_backend not in ("auto", "local"):
        lines.append(f"megatron-recover: --attention-backend {ns.attention_backend} has no "
                     "effect with the local layer spec: megatron-core's own attention runs")
    if ns.cross_entropy_loss_fusion and not cuda_available:
        lines.append("megatron-recover: --cross-entropy-loss-fusion: the fused kernel is "
                     "CUDA-only; the unfused vocab-parallel cross entropy computes the same loss")
    dp = _sizes(ns, world_size)[0]
    ep = ns.expert_model_parallel_size
    instances_chosen = (ns.recover and ns.use_distributed_optimizer
                        and ns.num_distributed_optimizer_instances is None)
    if instances_chosen and ep > 1:
        k = _optimizer_instances(ns, dp)
        fewer = [str(d) for d in range(2, k) if k % d == 0]  # K = 1 spans every replica
        lines.append(f"megatron-recover: --use-distributed-optimizer under --recover with "
                     f"--expert-model-parallel-size {ep}: {k} optimizer instances "
                     f"(--num-distributed-optimizer-instances {k}), each a replica of {ep} "
                     "data-parallel ranks, the smallest that holds an expert-parallel group (a "
                     "failure then takes a layer's experts down together and the survivors "
                     "hold complete copies)" + (
                         "; to shard the optimizer state over more ranks, pass "
                         f"--num-distributed-optimizer-instances {' or '.join(fewer)}"
                         if fewer else ""))
    elif instances_chosen and dp > 1:
        lines.append(f"megatron-recover: --use-distributed-optimizer under --recover: one "
                     f"optimizer instance per replica (--num-distributed-optimizer-instances "
                     f"{dp}), since optimizer state sharded across replicas would die with one "
                     "of them; each replica holds one data-parallel rank, so the optimizer state "
                     "is replicated, not sharded: to shard it within replicas, pass "
                     f"--num-distributed-optimizer-instances K, a divisor of {dp} (K replicas of "
                     f"{dp}/K data-parallel ranks)")
    if ns.num_experts is not None:
        lines.append(moe_arguments.layout_line(ns, world_size, _optimizer_instances(ns, dp)))
    unloaded = [flag for flag, given in (("--no-load-optim", ns.no_load_optim),
                                         ("--no-load-rng", ns.no_load_rng)) if given]
    if unloaded and ns.load is None and ns.pretrained_checkpoint is None:
        lines.append(f"megatron-recover: {' and '.join(unloaded)} "
                     f"{'have' if len(unloaded) > 1 else 'has'} no effect: nothing is "
                     "loaded (no --load or --pretrained-checkpoint), as in Megatron-LM")
    if ns.split is None and (ns.data_path is not None or ns.data_args_path is not None):
        lines.append(f"megatron-recover: --split not given: Megatron-LM's legacy default "
                     f"{LEGACY_DEFAULT_SPLIT!r} (it asks for --split with --data-path too)")
    given = [flag for flag, value in (
        ("--tiktoken-pattern", ns.tiktoken_pattern),
        ("--tiktoken-num-special-tokens",
         any(arg.split("=")[0] == "--tiktoken-num-special-tokens" for arg in argv)))
        if value]
    if given and _tokenizer_type(ns) != TIKTOKEN:
        lines.append(f"megatron-recover: {' and '.join(given)} has no effect with "
                     f"--tokenizer-type {_tokenizer_type(ns)} (only TikTokenizer reads it, as in "
                     "Megatron-LM)")
    given = [flag for flag in ("--null-tokenizer-eod-id", "--null-tokenizer-pad-id")
             if any(arg.split("=")[0] == flag for arg in argv)]
    if given and _tokenizer_type(ns) != NULL:
        lines.append(f"megatron-recover: {' and '.join(given)} has no effect with "
                     f"--tokenizer-type {_tokenizer_type(ns)} (only NullTokenizer reads it, as "
                     "in Megatron-LM)")
    if ns.check_for_nan_in_loss_and_grad and not _checks_for_nan(ns):
        lines.append("megatron-recover: the check for NaN and inf in the loss and gradients is "
                     "off, as Megatron-LM sets it with fp16's dynamic loss scaling, whose "
                     "overflows are inf by design (the scaler skips those steps)")
    if ns.sequence_parallel and ns.tensor_model_parallel_size == 1:
        lines.append("megatron-recover: --sequence-parallel has no effect with "
                     "--tensor-model-parallel-size 1 (Megatron-LM drops it too)")
    return tuple(lines) + tuple(
        argument_table.no_effect_lines(argument_table.no_effect_given(argv)))


def parse_args(argv: list[str], *, world_size: int, cuda_available: bool,
               te_available: bool = False, fusion_kernel_available: bool = False,
               grouped_gemm_available: bool = False,
               run_id: str | None = None) -> TrainConfig:
    """Parse a Megatron GPT command line into a validated TrainConfig.

    argv: the arguments without the program name. world_size: ranks at launch (from MPI).
    cuda_available: whether this rank trains on CUDA; on CPU, CUDA-only kernels are refused.
    te_available: whether Transformer Engine imports; without it its layers are refused.
    fusion_kernel_available: whether Apex's fused_weight_gradient_mlp_cuda imports; without it
    gradient accumulation fusion is refused on CUDA.
    grouped_gemm_available: whether the grouped_gemm package imports on CUDA (--moe-grouped-gemm
    with the local layers; Transformer Engine's layers bring their own).
    run_id: the job's id under `megatron-recover launch` (it names the snapshot directory).
    Raises ValueError (one message, a line per problem, each saying what to change)
    for a bad combination; argparse exits with status 2 on unknown or malformed arguments.
    Pure: reads only argv and the files it names (dataset, tokenizer, failure schedule).
    """
    argv, refused = argument_table.split_refused(argv)
    ns = build_parser().parse_args(argv)
    ns.snapshot_run_id = run_id
    if world_size < 1:
        raise ValueError(f"no training ranks: every rank of the launch is one of the "
                         f"--recover-standby-replicas {ns.recover_standby_replicas} standby "
                         "replicas; start more ranks (mpirun -np) or fewer standbys")
    _validate(ns, world_size, cuda_available, te_available, refused,
              wandb_available=bool(ns.wandb_project) and _wandb_imports(),
              fusion_kernel_available=fusion_kernel_available,
              grouped_gemm_available=grouped_gemm_available)
    tp = ns.tensor_model_parallel_size
    dp, gbs = _sizes(ns, world_size)
    batches = _global_batches(ns, world_size)
    fusion = ns.gradient_accumulation_fusion
    blend, blend_per_split, _ = _data_blends(ns)
    return TrainConfig(
        model=ModelConfig(
            num_layers=ns.num_layers, hidden_size=ns.hidden_size,
            ffn_hidden_size=_ffn_hidden_size(ns), num_attention_heads=ns.num_attention_heads,
            kv_channels=ns.kv_channels or ns.hidden_size // ns.num_attention_heads,
            num_query_groups=ns.num_query_groups if ns.group_query_attention else None,
            seq_length=ns.seq_length,
            max_position_embeddings=ns.max_position_embeddings or ns.seq_length,
            position_embedding_type=ns.position_embedding_type, rotary_base=ns.rotary_base,
            rotary_percent=ns.rotary_percent, normalization=ns.normalization,
            norm_epsilon=ns.norm_epsilon, swiglu=ns.swiglu,
            untie_embeddings_and_output_weights=ns.untie_embeddings_and_output_weights,
            add_bias_linear=ns.add_bias_linear, init_method_std=ns.init_method_std,
            hidden_dropout=ns.hidden_dropout, attention_dropout=ns.attention_dropout,
            make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by,
            transformer_impl=_transformer_impl(ns, te_available),
            apply_layernorm_1p=ns.apply_layernorm_1p, qk_layernorm=ns.qk_layernorm,
            attention_backend="flash" if ns.use_flash_attn else ns.attention_backend,
            cross_entropy_loss_fusion=ns.cross_entropy_loss_fusion and cuda_available,
            cross_entropy_fusion_impl=ns.cross_entropy_fusion_impl,
            recompute_granularity=_recompute_granularity(ns),
            recompute_method=ns.recompute_method,
            recompute_num_layers=ns.recompute_num_layers,
            calculate_per_token_loss=ns.calculate_per_token_loss,
            moe=moe_arguments.moe_config(ns, _ffn_hidden_size(ns))),
        optim=OptimConfig(
            lr=ns.lr, min_lr=ns.min_lr, lr_decay_style=ns.lr_decay_style,
            **_schedule_in_samples(ns, gbs),
            lr_warmup_init=ns.lr_warmup_init, lr_wsd_decay_style=ns.lr_wsd_decay_style,
            weight_decay=ns.weight_decay,
            start_weight_decay=_or(ns.start_weight_decay, ns.weight_decay),
            end_weight_decay=_or(ns.end_weight_decay, ns.weight_decay),
            weight_decay_incr_style=ns.weight_decay_incr_style,
            clip_grad=ns.clip_grad, adam_beta1=ns.adam_beta1, adam_beta2=ns.adam_beta2,
            adam_eps=ns.adam_eps, decoupled_lr=ns.decoupled_lr,
            decoupled_min_lr=ns.decoupled_min_lr,
            override_scheduler=ns.override_opt_param_scheduler,
            use_checkpoint_scheduler=ns.use_checkpoint_opt_param_scheduler),
        precision=PrecisionConfig(
            fp16=ns.fp16, bf16=ns.bf16, loss_scale=ns.loss_scale,
            initial_loss_scale=ns.initial_loss_scale, min_loss_scale=ns.min_loss_scale,
            loss_scale_window=ns.loss_scale_window, hysteresis=ns.hysteresis,
            accumulate_allreduce_grads_in_fp32=_grads_in_fp32(ns),
            attention_softmax_in_fp32=ns.attention_softmax_in_fp32,
            check_for_nan_in_loss_and_grad=_checks_for_nan(ns)),
        parallel=ParallelConfig(
            world_size=world_size, tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
            use_distributed_optimizer=ns.use_distributed_optimizer,
            num_distributed_optimizer_instances=_optimizer_instances(ns, dp),
            overlap_grad_reduce=ns.overlap_grad_reduce,
            overlap_param_gather=ns.overlap_param_gather, ddp_bucket_size=ns.ddp_bucket_size,
            sequence_parallel=ns.sequence_parallel and tp > 1,
            use_cpu_initialization=ns.use_cpu_initialization,
            gradient_accumulation_fusion=cuda_available if fusion is None else fusion,
            distributed_backend=ns.distributed_backend,
            ranks_per_device=ns.recover_ranks_per_device,
            virtual_pipeline_stages=virtual_stages(ns),
            microbatch_group_size=ns.microbatch_group_size_per_virtual_pipeline_stage,
            overlap_p2p_comm=ns.overlap_p2p_comm,
            overlap_p2p_comm_warmup_flush=ns.overlap_p2p_communication_warmup_flush,
            align_param_gather=ns.align_param_gather,
            expert_model_parallel_size=ns.expert_model_parallel_size),
        data=DataConfig(
            blend=blend, blend_per_split=blend_per_split, mock_data=ns.mock_data,
            split=(ns.split if ns.split is not None or ns.mock_data
                   or blend_per_split is not None else LEGACY_DEFAULT_SPLIT),
            data_cache_path=ns.data_cache_path, reset_position_ids=ns.reset_position_ids,
            reset_attention_mask=ns.reset_attention_mask, eod_mask_loss=ns.eod_mask_loss,
            create_attention_mask=ns.create_attention_mask_in_dataloader
            or ns.reset_attention_mask, mmap_bin_files=ns.mmap_bin_files,
            tokenizer_type=_tokenizer_type(ns), vocab_file=ns.vocab_file,
            merge_file=ns.merge_file, tokenizer_model=ns.tokenizer_model,
            vocab_size=ns.vocab_size,
            tiktoken_pattern=ns.tiktoken_pattern if _tokenizer_type(ns) == TIKTOKEN else None,
            tiktoken_num_special_tokens=ns.tiktoken_num_special_tokens,
            tokenizer_special_tokens=_special_tokens(ns) and tuple(_special_tokens(ns)),
            null_tokenizer_eod_id=ns.null_tokenizer_eod_id if _tokenizer_type(ns) == NULL
            else None,
            null_tokenizer_pad_id=ns.null_tokenizer_pad_id if _tokenizer_type(ns) == NULL
            else None),
        checkpoint=CheckpointConfig(
            save=ns.save, load=ns.load, save_interval=ns.save_interval,
            ckpt_format=ns.ckpt_format or "torch_dist",
            load_optim=not ns.no_load_optim, load_rng=not ns.no_load_rng,
            finetune=ns.finetune, pretrained_checkpoint=ns.pretrained_checkpoint,
            ckpt_step=ns.ckpt_step, exit_on_missing_checkpoint=ns.exit_on_missing_checkpoint,
            async_save=ns.async_save),
        recover=RecoverConfig(
            enabled=ns.recover, policy=ns.recover_policy or "static",
            mode=ns.recover_mode or "exact",
            failure_schedule=_path_or_none(ns.recover_failure_schedule),
            log=_path_or_none(ns.recover_log),
            hang_timeout_s=(DEFAULT_HANG_TIMEOUT_S if ns.recover_hang_timeout is None
                            else ns.recover_hang_timeout),
            restore=not ns.recover_no_restore,
            cuda_aware_mpi=ns.recover_cuda_aware_mpi,
            data_plane=data_plane(ns, cuda_available) if ns.recover else "mpi",
            program_errors=ns.recover_program_errors or "abort",
            cross_replica_backend="ulfm" if ns.recover else (ns.cross_replica_backend or "gloo"),
            standby_replicas=ns.recover_standby_replicas or 0,
            snapshot_interval=ns.recover_snapshot_interval or 0,
            snapshot_dir=_snapshot_dir(ns),
            sdc_check_rate=ns.recover_sdc_check_rate or 0.0,
            sdc_tolerance=ns.recover_sdc_tolerance or 0.0,
            nonfinite_rerun=ns.recover_nonfinite_rerun or "off",
            straggler_threshold=ns.recover_straggler_threshold or 0.0,
            straggler_window=_or(ns.recover_straggler_window, DEFAULT_STRAGGLER_WINDOW),
            evict_slower_than=ns.recover_evict_slower_than or 0.0),
        micro_batch_size=ns.micro_batch_size,
        global_batch_size=batches.global_batch_size, train_iters=_train_iters(ns, batches),
        step_batch_size_schedule=ns.step_batch_size_schedule,
        train_samples=ns.train_samples or ns.train_iters * gbs,
        seed=ns.seed,
        logging=LoggingConfig(
            log_interval=ns.log_interval, log_throughput=ns.log_throughput,
            tensorboard_dir=_path_or_none(ns.tensorboard_dir),
            tensorboard_log_interval=ns.tensorboard_log_interval,
            tensorboard_queue_size=ns.tensorboard_queue_size,
            log_loss_scale=ns.log_loss_scale_to_tensorboard,
            log_validation_ppl=ns.log_validation_ppl_to_tensorboard,
            log_world_size=ns.log_world_size_to_tensorboard,
            log_timers=ns.log_timers_to_tensorboard,
            wandb_project=ns.wandb_project or None, wandb_exp_name=ns.wandb_exp_name,
            wandb_save_dir=ns.wandb_save_dir, wandb_entity=ns.wandb_entity),
        # 0 turns these off, as in Megatron-LM's `if args.eval_interval and ...` tests.
        evaluation=EvalConfig(interval=ns.eval_interval or None, iters=ns.eval_iters),
        exit=ExitConfig(duration_mins=ns.exit_duration_in_mins or None,
                        interval=ns.exit_interval or None,
                        signal_handler=ns.exit_signal_handler, signal=ns.exit_signal),
        notices=_notices(ns, argv, world_size, cuda_available, te_available),
    )


def _train_iters(ns, batches: GlobalBatches) -> int:
    """--train-iters, or Megatron-LM core_v0.19.0's update_train_iters: the whole global batches
    in --train-samples, or with a batch-size schedule the iterations that start before they are
    consumed."""
    if ns.train_iters is not None:
        return ns.train_iters
    return batches.iterations_in(ns.train_samples)


def _schedule_in_samples(ns, gbs: int) -> dict:
    """OptimConfig's schedule fields in samples, as Megatron-LM's get_optimizer_param_scheduler
    computes them for an iteration-based or a sample-based run."""
    if ns.train_samples is not None:
        decay = ns.lr_decay_samples or ns.train_samples
        warmup, wsd = ns.lr_warmup_samples, ns.lr_wsd_decay_samples
    else:
        decay = (ns.lr_decay_iters or ns.train_iters) * gbs
        warmup = ns.lr_warmup_iters * gbs
        wsd = None if ns.lr_wsd_decay_iters is None else ns.lr_wsd_decay_iters * gbs
    if ns.lr_warmup_fraction is not None:
        warmup = ns.lr_warmup_fraction * decay  # Megatron's order of operations
    return dict(lr_decay_samples=decay, lr_warmup_samples=float(warmup),
                lr_wsd_decay_samples=wsd)


def _or(value, default):
    return default if value is None else value


def _wandb_imports() -> bool:
    try:
        import wandb  # noqa: F401
    except Exception:
        return False
    return True


def _path_or_none(value: str | None) -> Path | None:
    return None if value is None else Path(value)


def hang_timeout_before_mpi(argv: list[str]) -> float | None:
    """The hang bound of a --recover run, read before MPI starts (the failure detector is
    configured through MPI's start-up); None without --recover or with hang detection off.
    The full parse, after MPI starts, validates the same value."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--recover", action="store_true")
    pre.add_argument("--recover-hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT_S)
    ns, _ = pre.parse_known_args(argv)
    if not ns.recover or ns.recover_hang_timeout <= 0:
        return None
    return ns.recover_hang_timeout
