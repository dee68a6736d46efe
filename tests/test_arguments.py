"""The argument layer of pretrain_gpt_recover.py: megatron_recover/megatron/config/arguments.py (the
parser), config.py (the TrainConfig) and mcore_config.py (megatron-core config objects).

Run:  .venv/bin/python -m pytest tests/test_arguments.py -q -p no:cacheprovider
Hardware: none beyond a CPU; pure in-process, a few seconds. `cuda_available` is a parameter
of parse_args, so the CUDA-only paths (gradient-accumulation fusion, Transformer Engine) are
checked here without a GPU; the megatron-core config objects are built but no model is.

What it checks: a Megatron GPT command line from Megatron-LM's examples parses with Megatron's
defaults and meanings; derived values (data-parallel size, replicas, B, microbatches, warmup);
every refused argument stops with a ValueError that names the flag and what to change; no-effect
flags are named at start-up with their reason; unknown flags are argparse errors; TransformerConfig,
DistributedDataParallelConfig, OptimizerConfig, OptimizerParamScheduler and PolicyConfig build
from the result and carry its values.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_recover.hang import DEFAULT_HANG_TIMEOUT_S
from megatron_recover.megatron.config import argument_table
from megatron_recover.megatron.config.arguments import (
    LEGACY_DEFAULT_SPLIT,
    build_parser,
    parse_args,
)
from megatron_recover.megatron.config.mcore_config import (
    padded_vocab_size,
    to_ddp_config,
    to_optimizer_config,
    to_policy_config,
    to_scheduler_kwargs,
    to_transformer_config,
)

# A small CPU job: 2 layers, mock data, no tokenizer files needed.
SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 "
         "--train-iters 20 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
         "--vocab-size 100").split()


def _small_argv(extra, drop=()) -> list[str]:
    """SMALL + extra, without the flags in `drop` (and their values)."""
    argv = list(SMALL)
    for flag in drop:
        i = argv.index(flag)
        del argv[i:i + 2]
    return argv + list(extra)


def small(*extra, world_size=4, cuda_available=False, drop=(), fusion_kernel=True):
    """SMALL + extra parsed; on CUDA with Apex's fusion kernel importing unless told not."""
    return parse_args(_small_argv(extra, drop), world_size=world_size,
                      cuda_available=cuda_available,
                      fusion_kernel_available=cuda_available and fusion_kernel)


def refused(*extra, world_size=4, cuda_available=False, argv=None, drop=(),
            fusion_kernel=True) -> str:
    """The ValueError message for SMALL + extra (or argv); fails the test if it parses."""
    with pytest.raises(ValueError) as info:
        parse_args(argv if argv is not None else _small_argv(extra, drop),
                   world_size=world_size, cuda_available=cuda_available,
                   fusion_kernel_available=cuda_available and fusion_kernel)
    return str(info.value)


@pytest.fixture
def gpt2_files(tmp_path):
    """An indexed dataset prefix and GPT-2 tokenizer files (contents are not read at parse time)."""
    prefix = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    return {"prefix": str(prefix), "vocab": str(tmp_path / "vocab.json"),
            "merges": str(tmp_path / "merges.txt"), "dir": tmp_path}


def gpt3_argv(files) -> list[str]:
    """Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, less --rampup-batch-size."""
    return [
        "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
        "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "1536", "--train-iters", "500000",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
        "--lr-decay-iters", "430000",
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
        "--data-path", files["prefix"], "--vocab-file", files["vocab"],
        "--merge-file", files["merges"], "--split", "949,50,1",
        "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", str(files["dir"] / "ckpt"), "--load", str(files["dir"] / "ckpt"),
        "--eval-iters", "10", "--tensorboard-dir", str(files["dir"] / "tb"),
    ]


# --------------------------------------------------------------------------------------------
# A real command line, Megatron's defaults, derived values
# --------------------------------------------------------------------------------------------


def test_megatron_gpt3_example_parses(gpt2_files):
    cfg = parse_args(gpt3_argv(gpt2_files), world_size=1024, cuda_available=True,
                     fusion_kernel_available=True)
    m, o, p, par, d = cfg.model, cfg.optim, cfg.precision, cfg.parallel, cfg.data
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (96, 12288, 96)
    assert m.ffn_hidden_size == 4 * 12288 and m.kv_channels == 128
    assert (m.seq_length, m.max_position_embeddings) == (2048, 2048)
    assert m.init_method_std == 0.006 and m.position_embedding_type == "learned_absolute"
    assert (o.lr, o.min_lr, o.lr_decay_style) == (6e-5, 6e-6, "cosine")
    assert o.lr_decay_samples == 430000 * 1536  # iterations x GBS: Megatron's scheduler steps
    assert (o.weight_decay, o.adam_beta2, o.clip_grad) == (0.1, 0.95, 1.0)
    assert p.fp16 and not p.bf16 and p.params_dtype == torch.float16
    assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size) == (8, 16)
    assert d.blend == ((gpt2_files["prefix"],), None) and d.split == "949,50,1"
    assert d.tokenizer_type == "GPT2BPETokenizer"  # inferred from --vocab-file + --merge-file
    assert cfg.checkpoint.save_interval == 10000 and cfg.checkpoint.load.endswith("ckpt")
    # 1024 ranks / (TP 8 x PP 16) = 8 data-parallel ranks, each its own replica.
    assert cfg.data_parallel_size == 8 and cfg.num_replicas == 8
    assert cfg.dp_ranks_per_replica == 1 and par.ranks_per_replica == 128
    assert cfg.b == 1536 and cfg.num_microbatches_per_dp_rank == 192
    assert cfg.num_microbatches_per_replica == 192
    assert o.lr_warmup_samples == pytest.approx(430.0 * 1536)
    assert cfg.train_samples == 500000 * 1536
    # --attention-backend auto is the default; every logging flag of the script is implemented.
    assert cfg.notices[0].startswith("megatron-recover: --transformer-impl not given: local")
    # --fp16 with dynamic loss scaling turns the NaN check off, as Megatron-LM warns it does.
    assert len(cfg.notices) == 2 and cfg.notices[1].startswith(
        "megatron-recover: the check for NaN and inf in the loss and gradients is off")
    assert not cfg.precision.check_for_nan_in_loss_and_grad
    assert (cfg.evaluation.interval, cfg.evaluation.iters) == (1000, 10)
    assert cfg.evaluation.evaluations(cfg.train_iters) == 501  # one per interval, one at the end
    assert cfg.logging.tensorboard_dir == gpt2_files["dir"] / "tb"
    assert cfg.logging.log_interval == 100 and cfg.logging.tensorboard_log_interval == 1
    assert cfg.model.transformer_impl == "local"  # not given, and TE does not import here
    assert not cfg.recover.enabled


def test_megatron_defaults():
    minimal = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
               "--micro-batch-size 2 --train-iters 20 --lr 1e-3 --mock-data --vocab-size 100")
    cfg = parse_args(minimal.split(), world_size=4, cuda_available=False)
    m, o, p, par = cfg.model, cfg.optim, cfg.precision, cfg.parallel
    assert cfg.global_batch_size == 2 * 4  # mbs x dp, as Megatron-LM defaults it
    assert m.max_position_embeddings == m.seq_length
    assert m.ffn_hidden_size == 256 and m.normalization == "LayerNorm"
    assert (m.hidden_dropout, m.attention_dropout, m.init_method_std) == (0.1, 0.1, 0.02)
    assert m.add_bias_linear and not m.swiglu and not m.untie_embeddings_and_output_weights
    assert m.num_query_groups is None and m.make_vocab_size_divisible_by == 128
    assert (o.min_lr, o.lr_decay_style, o.lr_decay_samples, o.lr_warmup_samples) == (
        0.0, "linear", 20 * 8, 0.0)
    assert (o.weight_decay, o.clip_grad, o.adam_beta1, o.adam_beta2, o.adam_eps) == (
        0.01, 1.0, 0.9, 0.999, 1e-8)
    assert cfg.seed == 1234 and cfg.log_interval == 100
    assert p.params_dtype == torch.float32 and not p.accumulate_allreduce_grads_in_fp32
    assert not par.gradient_accumulation_fusion  # no such kernel on CPU
    assert par.num_distributed_optimizer_instances == 1 and par.ddp_bucket_size is None
    assert cfg.data.split is None  # mock data: megatron-core picks its own even split
    assert cfg.recover.policy == "static" and cfg.recover.mode == "exact"
    assert cfg.recover.hang_timeout_s == DEFAULT_HANG_TIMEOUT_S
    assert cfg.data.tokenizer_type == "NullTokenizer"  # inferred from --vocab-size alone
    assert cfg.notices == (  # Megatron-LM's default layer spec cannot run here: said once
        "megatron-recover: --transformer-impl not given: local (megatron-core's own layers, "
        "since Transformer Engine does not import here; Megatron-LM's default is "
        "transformer_engine)",)
    assert cfg.data.create_attention_mask and cfg.checkpoint.ckpt_format == "torch_dist"
    assert m.kv_channels == 16 and not (m.apply_layernorm_1p or m.qk_layernorm)
    assert m.recompute_granularity is None and o.decoupled_lr is None
    assert o.start_weight_decay == o.end_weight_decay == o.weight_decay


def test_gradient_accumulation_fusion_follows_the_device():
    assert small(cuda_available=True).parallel.gradient_accumulation_fusion
    assert not small("--no-gradient-accumulation-fusion",
                     cuda_available=True).parallel.gradient_accumulation_fusion
    assert not small().parallel.gradient_accumulation_fusion
    # Megatron's default on CUDA needs Apex's kernel (megatron-core's linear layers raise
    # without it): start-up says so, and what to pass instead.
    message = refused(cuda_available=True, fusion_kernel=False)
    assert ("needs Apex's fused_weight_gradient_mlp_cuda kernel, which does not import here: "
            "add --no-gradient-accumulation-fusion") in message
    assert "fused_weight_gradient" in refused("--gradient-accumulation-fusion",
                                              cuda_available=True, fusion_kernel=False)
    assert not small("--no-gradient-accumulation-fusion", cuda_available=True,
                     fusion_kernel=False).parallel.gradient_accumulation_fusion


def test_distributed_backend_and_ranks_per_device():
    par = small().parallel
    assert (par.distributed_backend, par.ranks_per_device) == ("nccl", 1)  # Megatron's default
    assert small("--distributed-backend", "gloo").parallel.distributed_backend == "gloo"
    assert small("--recover-ranks-per-device", "4",
                 cuda_available=True).parallel.ranks_per_device == 4
    assert "must be a positive integer, got 0" in refused("--recover-ranks-per-device", "0")
    # Two ranks of one NCCL group on one GPU: NCCL refuses it, so start-up does first.
    message = refused("--recover-ranks-per-device", "2", "--tensor-model-parallel-size", "2",
                      cuda_available=True)
    assert "a replica here has 2 ranks" in message and "NCCL refuses" in message
    # The CPU's groups are gloo, and gloo has no such rule.
    assert small("--recover-ranks-per-device", "2", "--tensor-model-parallel-size",
                 "2").parallel.ranks_per_device == 2


def test_cuda_aware_mpi_only_with_recover_and_cuda():
    assert not small("--recover").recover.cuda_aware_mpi  # staged by default
    assert small("--recover", "--recover-cuda-aware-mpi",
                 cuda_available=True).recover.cuda_aware_mpi
    assert "passes CUDA buffers to MPI, and this machine trains on the CPU" in refused(
        "--recover", "--recover-cuda-aware-mpi")
    assert "--recover-cuda-aware-mpi given without --recover" in refused(
        "--recover-cuda-aware-mpi", cuda_available=True)


def test_megatron_load_flags():
    c = small("--load", "d", "--no-load-optim", "--no-load-rng", "--ckpt-step", "4",
              "--exit-on-missing-checkpoint").checkpoint
    assert (c.load_optim, c.load_rng, c.ckpt_step, c.exit_on_missing_checkpoint) == (
        False, False, 4, True)
    c = small("--pretrained-checkpoint", "p", "--finetune").checkpoint
    assert c.finetune and c.pretrained_checkpoint == "p" and c.load is None
    assert "--ckpt-step says what to load, and nothing is loaded" in refused("--ckpt-step", "4")
    assert "--exit-on-missing-checkpoint applies to --load" in refused(
        "--exit-on-missing-checkpoint")
    assert any("--no-load-optim and --no-load-rng have no effect: nothing is loaded" in line
               for line in small("--no-load-optim", "--no-load-rng").notices)
    assert "--ckpt-step must name a saved iteration" in refused("--load", "d", "--ckpt-step", "0")
    assert small("--save", "d", "--save-interval", "2", "--async-save").checkpoint.async_save
    assert "--async-save writes megatron-core distributed checkpoints" in refused(
        "--recover", "--ckpt-format", "torch", "--async-save")


def test_legacy_split_default_with_data_path(gpt2_files):
    cfg = parse_args([a for a in SMALL if a != "--mock-data"]
                     + ["--data-path", gpt2_files["prefix"]], world_size=4, cuda_available=False)
    assert cfg.data.split == LEGACY_DEFAULT_SPLIT and not cfg.data.mock_data
    assert any("--split not given: Megatron-LM's legacy default" in line for line in cfg.notices)


def test_swiglu_ffn_rule_and_model_switches():
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "4096", "--num-attention-heads", "32",
                      "--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "5",
                      "--lr", "1e-4", "--mock-data", "--vocab-size", "64", "--swiglu",
                      "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                      "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                      "--group-query-attention", "--num-query-groups", "8"],
                     world_size=1, cuda_available=False)
    m = cfg.model
    assert m.ffn_hidden_size == 10880  # int(4*4096*2/3 / 64) * 64
    assert m.swiglu and m.normalization == "RMSNorm" and m.position_embedding_type == "rope"
    assert not m.add_bias_linear and m.untie_embeddings_and_output_weights
    assert m.num_query_groups == 8
    assert small("--ffn-hidden-size", "96", "--swiglu").model.ffn_hidden_size == 96


def test_replicas_without_and_with_distributed_optimizer_instances():
    plain = small("--tensor-model-parallel-size", "2", world_size=8)
    assert plain.data_parallel_size == 4 and plain.num_replicas == 4
    assert plain.dp_ranks_per_replica == 1 and plain.parallel.ranks_per_replica == 2
    assert plain.b == 8 and plain.num_microbatches_per_dp_rank == 2
    assert plain.num_microbatches_per_replica == 2

    inst = small("--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
                 "--recover", world_size=8)
    assert inst.data_parallel_size == 8 and inst.num_replicas == 2
    assert inst.dp_ranks_per_replica == 4 and inst.parallel.ranks_per_replica == 4
    assert inst.b == 8 and inst.num_microbatches_per_dp_rank == 1
    assert inst.num_microbatches_per_replica == 4  # each replica holds 4 ids per iteration

    # Without --recover the full distributed optimizer is stock Megatron: one instance, one replica.
    full = small("--use-distributed-optimizer", world_size=8)
    assert full.num_replicas == 1 and full.dp_ranks_per_replica == 8


def test_recover_options():
    cfg = small("--recover", "--recover-policy", "adaptive", "--recover-log", "run.jsonl",
                "--recover-hang-timeout", "30")
    r = cfg.recover
    assert r.enabled and r.policy == "adaptive" and r.mode == "exact"
    assert str(r.log) == "run.jsonl" and r.hang_timeout_s == 30.0 and r.failure_schedule is None
    assert small("--recover", "--recover-mode", "reserve").recover.mode == "reserve"


def test_verification_options():
    r = small("--recover", "--recover-sdc-check-rate", "0.25",
              "--recover-sdc-tolerance", "1e-6").recover
    assert (r.sdc_check_rate, r.sdc_tolerance) == (0.25, 1e-6)
    assert small("--recover").recover.sdc_check_rate == 0.0
    assert "given without --recover" in refused("--recover-sdc-check-rate", "1")
    assert "a probability in [0, 1], got 1.5" in refused("--recover", "--recover-sdc-check-rate",
                                                         "1.5")
    assert "must be >= 0 (0: bitwise), got -1.0" in refused(
        "--recover", "--recover-sdc-check-rate", "1", "--recover-sdc-tolerance", "-1")
    assert "without --recover-sdc-check-rate" in refused("--recover", "--recover-sdc-tolerance",
                                                         "0.1")
    assert "equal only in exact mode" in refused("--recover", "--recover-mode", "reserve",
                                                 "--recover-sdc-check-rate", "0.5")
    one = refused("--recover", "--recover-sdc-check-rate", "0.5", "--tensor-model-parallel-size",
                  "4")
    assert "needs a second replica" in one and "this job has 1" in one
    assert small("--recover", "--recover-sdc-check-rate", "0", "--tensor-model-parallel-size",
                 "4").recover.sdc_check_rate == 0.0


def test_nonfinite_rerun_options():
    assert small("--recover").recover.nonfinite_rerun == "off"
    assert small("--recover", "--recover-nonfinite-rerun", "keep").recover.nonfinite_rerun == "keep"
    assert "given without --recover" in refused("--recover-nonfinite-rerun", "evict")
    assert "--no-check-for-nan-in-loss-and-grad): drop --recover-nonfinite-rerun" in refused(
        "--recover", "--recover-nonfinite-rerun", "evict", "--no-check-for-nan-in-loss-and-grad")
    assert "leaves non-finite gradients to the loss scaler" in refused(
        "--recover", "--recover-nonfinite-rerun", "keep", "--fp16")
    assert small("--recover", "--recover-nonfinite-rerun", "off",
                 "--no-check-for-nan-in-loss-and-grad").recover.nonfinite_rerun == "off"


def test_straggler_options():
    recover = small("--recover").recover
    assert (recover.straggler_threshold, recover.straggler_window,
            recover.evict_slower_than) == (0.0, 5, 0.0)
    recover = small("--recover", "--recover-straggler-threshold", "0.25",
                    "--recover-straggler-window", "3", "--recover-evict-slower-than", "4").recover
    assert (recover.straggler_threshold, recover.straggler_window,
            recover.evict_slower_than) == (0.25, 3, 4.0)
    assert "given without --recover" in refused("--recover-straggler-threshold", "0.2")
    assert "has no effect: add one or drop it" in refused("--recover",
                                                          "--recover-straggler-window", "3")
    assert "window must be an integer >= 2" in refused(
        "--recover", "--recover-straggler-threshold", "0.2", "--recover-straggler-window", "1")
    assert "threshold must be >= 0" in refused("--recover", "--recover-straggler-threshold",
                                               "-1")
    assert "must be above 1 + threshold = 1.5" in refused(
        "--recover", "--recover-straggler-threshold", "0.5", "--recover-evict-slower-than", "1.2")
    assert "use --recover-policy static" in refused(
        "--recover", "--recover-policy", "adaptive", "--recover-straggler-threshold", "0.2")


def test_warmup_resolved_from_fraction():
    cfg = small("--lr-warmup-fraction", "0.25", "--lr-decay-iters", "10")
    gbs = cfg.global_batch_size
    assert cfg.optim.lr_warmup_samples == 2.5 * gbs
    assert small("--lr-warmup-iters", "3").optim.lr_warmup_samples == 3.0 * gbs


def test_sample_based_training():
    """Megatron-LM's sample-based form: --train-samples with the schedule in samples."""
    cfg = small("--train-samples", "100", "--lr-decay-samples", "90", "--lr-warmup-samples", "10",
                drop=("--train-iters",))
    gbs = cfg.global_batch_size
    assert cfg.train_iters == 100 // gbs and cfg.train_samples == 100  # whole batches only
    assert (cfg.optim.lr_decay_samples, cfg.optim.lr_warmup_samples) == (90, 10.0)
    kwargs = to_scheduler_kwargs(cfg)
    assert (kwargs["lr_decay_steps"], kwargs["lr_warmup_steps"], kwargs["wd_incr_steps"]) == (
        90, 10.0, 100)
    default = small("--train-samples", "64", "--lr-warmup-fraction", "0.25",
                    drop=("--train-iters",))
    assert default.optim.lr_decay_samples == 64 and default.optim.lr_warmup_samples == 16.0
    wsd = small("--train-samples", "64", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples",
                "8", drop=("--train-iters",))
    assert to_scheduler_kwargs(wsd)["wsd_decay_steps"] == 8


def megatron_lm_train_iters(train_samples, schedule, seq_length, mbs, dp):
    """Megatron-LM core_v0.19.0's update_train_iters, driving megatron-core's own calculator as
    its set_global_variables builds it (thresholds in tokens of --seq-length): the size of each
    iteration it trains (written here independently of our schedule)."""
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    calculator = StepBatchsizeNumMicroBatchesCalculator(mbs, dp, False, -1, schedule, seq_length)
    sizes, consumed = [], 0
    while consumed < train_samples:
        calculator.update(consumed, consistency_check=True)  # divisible by mbs x dp, too
        sizes.append(calculator.get_current_global_batch_size())
        consumed += sizes[-1]
    return sizes


SCHEDULE_ONLY = ("--train-iters", "--global-batch-size")  # what a schedule's argv drops


@pytest.mark.parametrize("schedule, train_samples, world_size", [
    ("0:8 2048:16", 400, 4),  # 2048 tokens of --seq-length 32: 64 samples
    ("0:8 2047:16", 400, 4),  # 63 samples
    ("0:4 100:8 3.2K:12 9.6K:16", 1000, 2),
    ("0:8 9.6K:16 32K:32", 250, 4),  # --train-samples ends inside the 16s: 32 never reached
    ("0:16", 41, 4)])  # one step: a partial last batch is trained whole
def test_step_batch_size_schedule_follows_megatron_lm(schedule, train_samples, world_size):
    """--step-batch-size-schedule with sample-based training: the iteration count, each
    iteration's global batch, the policy's B per iteration and the learning-rate schedule in
    samples are Megatron-LM core_v0.19.0's; evaluation and checkpoints keep its default
    --global-batch-size (mbs x dp)."""
    cfg = small("--train-samples", str(train_samples), "--step-batch-size-schedule", schedule,
                "--lr-decay-samples", "90", "--lr-warmup-samples", "10", drop=SCHEDULE_ONLY,
                world_size=world_size)
    sizes = megatron_lm_train_iters(train_samples, schedule, 32, 2, cfg.data_parallel_size)
    assert cfg.train_iters == len(sizes) and cfg.step_batch_size_schedule == schedule
    batches = cfg.global_batches
    assert [batches.size(t) for t in range(1, len(sizes) + 1)] == sizes
    assert batches.first_sample(cfg.train_iters) < train_samples
    assert cfg.main_samples == batches.consumed_after(cfg.train_iters) >= train_samples
    assert cfg.train_samples == train_samples  # the split Megatron-LM asks for
    final = int(schedule.split()[-1].split(":")[1])
    assert cfg.global_batch_size == final and cfg.b == final // 2
    assert cfg.eval_global_batch_size == 2 * cfg.data_parallel_size
    policy = to_policy_config(cfg)
    assert [policy.b_at(t) for t in range(1, len(sizes) + 1)] == [s // 2 for s in sizes]
    assert to_scheduler_kwargs(cfg)["lr_decay_steps"] == 90  # the schedule stays in samples


SAMPLES = ("--train-samples", "400")


@pytest.mark.parametrize("extra, drop, expected", [
    (["--step-batch-size-schedule", "0:8 2048:16", *SAMPLES], ("--train-iters",),
     "Cannot specify both --step-batch-size-schedule and --global-batch-size"),
    (["--step-batch-size-schedule", "0:8 2048:16"], ("--global-batch-size",),
     "--step-batch-size-schedule with --train-iters: Megatron-LM core_v0.19.0 counts"),
    (["--step-batch-size-schedule", "0:8 2048", *SAMPLES], SCHEDULE_ONLY,
     'Invalid schedule entry "2048". Expected format: "THRESHOLD:BATCH_SIZE"'),
    (["--step-batch-size-schedule", "0:8 2kb:16", *SAMPLES], SCHEDULE_ONLY,
     'Invalid schedule entry "2kb:16": '),
    (["--step-batch-size-schedule", "64:8 2048:16", *SAMPLES], SCHEDULE_ONLY,
     "first schedule entry must have threshold 0, got 2"),
    (["--step-batch-size-schedule", "0:8 2048:16 2050:32", *SAMPLES], SCHEDULE_ONLY,
     "schedule thresholds must be strictly increasing, got 64 before 64"),
    (["--step-batch-size-schedule", "0:8 1:16", *SAMPLES], SCHEDULE_ONLY,  # 1 token: sample 0
     "schedule thresholds must be strictly increasing, got 0 before 0"),
    (["--step-batch-size-schedule", "0:8 2048:0", *SAMPLES], SCHEDULE_ONLY,
     "batch size must be positive, got 0"),
    (["--step-batch-size-schedule", "0:8 2048:12", *SAMPLES], SCHEDULE_ONLY,
     "the global batch sizes [12] are not divisible by --micro-batch-size 2 x data-parallel "
     "size 4 (megatron-core asserts it"),
    (["--step-batch-size-schedule", "0:16 2048:8", *SAMPLES], SCHEDULE_ONLY,
     "the global batch size decreases from 16 to 8 at 64 samples"),
])
def test_step_batch_size_schedule_refused_where_megatron_lm_refuses(extra, drop, expected):
    """Megatron-LM's refusal, megatron-core's parsing and validation errors (its messages) and
    its divisibility assertion, at start-up; and what the policy cannot lay out."""
    message = refused(*extra, drop=drop)
    assert expected in message, message


@pytest.mark.parametrize("values", [["16", "16", "5859375"], ["8", "8"], ["x"], []])
def test_rampup_batch_size_is_refused_as_deprecated(values):
    """Megatron-LM core_v0.19.0 accepts --rampup-batch-size and ignores it (megatron-core 0.19
    has no ramp-up calculator): refused here, whatever its values and training unit."""
    reason = argument_table.table(build_parser())["--rampup-batch-size"].reason
    assert reason.startswith("deprecated by Megatron-LM 0.19, whose calculator ignores")
    for drop, extra in (((), ()), (("--train-iters",), ("--train-samples", "400"))):
        message = refused(*extra, "--rampup-batch-size", *values, drop=drop)
        assert f"--rampup-batch-size: {reason}" in message


@pytest.mark.parametrize("extra, drop, expected", [
    (["--train-samples", "64"], (), "exactly one of --train-iters"),
    ([], ("--train-iters",), "pass --train-iters (or --train-samples)"),
    (["--lr-decay-samples", "64"], (), "--lr-decay-samples with iteration-based training"),
    (["--train-samples", "64", "--lr-warmup-iters", "2"], ("--train-iters",),
     "--lr-warmup-iters with sample-based training"),
    (["--train-samples", "64", "--lr-decay-style", "WSD"], ("--train-iters",),
     "--lr-wsd-decay-samples"),
])
def test_training_unit_mixed_up(extra, drop, expected):
    assert expected in refused(*extra, drop=drop)


def test_padded_vocab_size():
    cfg = small("--tensor-model-parallel-size", "2")
    assert padded_vocab_size(cfg, 50257) == 50432  # next multiple of 128 x TP 2 = 256
    assert padded_vocab_size(cfg, 512) == 512


# --------------------------------------------------------------------------------------------
# Refused arguments and bad combinations: each message names the flag and the change
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, expected", [
    (["--num-layers-per-virtual-pipeline-stage", "1"],
     ["--num-layers-per-virtual-pipeline-stage needs pipeline parallelism",
      "add --pipeline-model-parallel-size 2"]),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage",
      "1", "--pipeline-model-parallel-size", "2"], ["mutually exclusive: keep one"]),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-model-parallel-size", "2"],
     ["--num-layers 2 does not split into 2 pipeline stages x 2 virtual stages",
      "use a multiple of 4 layers"]),
    (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "3",
      "--pipeline-model-parallel-size", "2"],
     ["number of layers per pipeline stage (4) must be divisible by "
      "--num-layers-per-virtual-pipeline-stage 3"]),
    # 16 samples / (2 x DP 2) = 4 microbatches per rank; groups of 3 leave 1 < PP.
    (["--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2",
      "--pipeline-model-parallel-size", "2", "--microbatch-group-size-per-virtual-pipeline-stage",
      "3"], ["the interleaved schedule refuses a global batch of 16 samples (4 micro-batches per "
             "data-parallel rank)", "the remainder of M=4", "but it is 1",
             "set --microbatch-group-size-per-virtual-pipeline-stage"]),
    (["--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2",
      "--pipeline-model-parallel-size", "2", "--microbatch-group-size-per-virtual-pipeline-stage",
      "5"], ["should range in [PP=2, M=4], got 5"]),
    (["--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2",
      "--pipeline-model-parallel-size", "2", "--no-overlap-p2p-communication"],
     ["each stage is then both the other's previous and next stage",
      "drop --no-overlap-p2p-communication"]),
    (["--microbatch-group-size-per-virtual-pipeline-stage", "2"],
     ["--microbatch-group-size-per-virtual-pipeline-stage applies to the interleaved schedule"]),
    (["--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2",
      "--pipeline-model-parallel-size", "2", "--no-overlap-p2p-communication",
      "--overlap-p2p-communication-warmup-flush"],
     ["--overlap-p2p-communication-warmup-flush overlaps", "drop one"]),
])
def test_the_interleaved_schedule_refuses_what_megatron_refuses(extra, expected):
    message = refused(*extra)
    for text in expected:
        assert text in message, (text, message)


def test_every_global_batch_of_a_schedule_must_fit_the_interleaved_schedule():
    interleaved = ["--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2",
                   "--pipeline-model-parallel-size", "2", "--train-samples", "2000"]
    # The schedule's first global batch (4) gives each data-parallel rank 1 microbatch (< PP).
    message = refused(*interleaved, "--step-batch-size-schedule", "0:4 3200:16",
                      drop=SCHEDULE_ONLY)
    assert "refuses a global batch of 4 samples (1 micro-batches per data-parallel rank)" in message
    small(*interleaved, "--step-batch-size-schedule", "0:8 3200:16", drop=SCHEDULE_ONLY)


def test_the_interleaved_schedule_is_configured_as_megatron_lm_configures_it():
    cfg = parse_args(_small_argv(["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                                  "--num-layers-per-virtual-pipeline-stage", "2"]),
                     world_size=4, cuda_available=False)
    assert cfg.parallel.virtual_pipeline_stages == 2 and cfg.parallel.model_chunks == 2
    tconfig = to_transformer_config(cfg)
    assert tconfig.virtual_pipeline_model_parallel_size == 2
    assert tconfig.microbatch_group_size_per_vp_stage == 2  # PP, megatron-core's default
    assert tconfig.overlap_p2p_comm and not tconfig.batch_p2p_comm  # Megatron-LM's default
    plain = to_transformer_config(parse_args(
        _small_argv(["--pipeline-model-parallel-size", "2"]), world_size=4,
        cuda_available=False))
    assert plain.virtual_pipeline_model_parallel_size is None
    assert not plain.overlap_p2p_comm and plain.batch_p2p_comm
    # One virtual stage per rank is the plain schedule, as in Megatron-LM (and the PP=2 refusal
    # of batched sends does not apply to it).
    for one in (["--num-virtual-stages-per-pipeline-rank", "1"],
                ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "2"]):
        cfg = parse_args(_small_argv([*one, "--pipeline-model-parallel-size", "2",
                                      "--no-overlap-p2p-communication"]),
                         world_size=4, cuda_available=False)
        assert cfg.parallel.virtual_pipeline_stages is None and cfg.parallel.model_chunks == 1
        tconfig = to_transformer_config(cfg)
        assert tconfig.virtual_pipeline_model_parallel_size is None
        assert not tconfig.overlap_p2p_comm and tconfig.batch_p2p_comm


@pytest.mark.parametrize("extra, expected", [
    (["--context-parallel-size", "2"], ["--context-parallel-size", "CP = 1"]),
    (["--expert-model-parallel-size", "2"],
     ["--expert-model-parallel-size configure mixture-of-experts layers", "add --num-experts"]),
    (["--num-experts", "8", "--moe-grouped-gemm"],
     ["--moe-grouped-gemm", "CUDA kernel", "drop it"]),
    (["--num-experts", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--moe-token-dispatcher-type", "alltoall"],
     ["gloo's all-gather refuses", "--moe-token-dispatcher-type allgather"]),
    (["--rampup-batch-size", "16", "16", "5859375"],
     ["--rampup-batch-size: deprecated by Megatron-LM 0.19",
      "give the ramp as --step-batch-size-schedule"]),
    (["--overlap-param-gather", "--overlap-grad-reduce"],
     ["--overlap-param-gather only works with the distributed optimizer",
      "add --use-distributed-optimizer"]),
    (["--overlap-param-gather", "--use-distributed-optimizer"],
     ["--overlap-param-gather needs --overlap-grad-reduce"]),
    (["--decrease-batch-size-if-needed"], ["--decrease-batch-size-if-needed", "drop it"]),
    (["--gradient-accumulation-fusion"],
     ["--gradient-accumulation-fusion", "--no-gradient-accumulation-fusion"]),
    (["--transformer-impl", "transformer_engine"],
     ["Transformer Engine does not import", "--transformer-impl local"]),
    (["--use-flash-attn"], ["--use-flash-attn", "--transformer-impl local"]),
    (["--cross-entropy-fusion-impl", "te"], ["--cross-entropy-fusion-impl te"]),
    (["--fp8-format", "hybrid"], ["--fp8-format: fp8/fp4 training needs a CUDA device", "--bf16"]),
    (["--tp-comm-overlap"], ["--tp-comm-overlap", "needs a CUDA device"]),
    (["--profile"], ["--profile: the CUDA profiler", "needs a CUDA device"]),
])
def test_refused_on_cpu(extra, expected):
    message = refused(*extra)
    for text in expected:
        assert text in message, (text, message)


def test_mixed_precision_on_either_device():
    for cuda in (False, True):
        assert small("--bf16", cuda_available=cuda).precision.bf16
        assert small("--fp16", cuda_available=cuda).precision.fp16


def test_refused_flags_accept_the_value_we_run():
    cfg = small("--context-parallel-size", "1", "--expert-model-parallel-size=1",
                "--optimizer", "adam", "--dataloader-type", "single")
    assert cfg.notices == small().notices  # nothing to say: these ask for what happens anyway
    assert "--optimizer: Adam is the only optimizer" in refused("--optimizer", "sgd")


def test_transformer_engine_options_pass_where_it_imports():
    cfg = parse_args(_small_argv(["--use-flash-attn", "--cross-entropy-loss-fusion"]),
                     world_size=4, cuda_available=True, te_available=True,
                     fusion_kernel_available=True)
    m = cfg.model
    assert m.transformer_impl == "transformer_engine" and m.attention_backend == "flash"
    assert m.cross_entropy_loss_fusion
    assert "transformer_engine (Transformer Engine imports here" in cfg.notices[0]
    tc = to_transformer_config(cfg)
    assert tc.cross_entropy_loss_fusion and tc.attention_backend.name == "flash"


def test_sequence_parallel_runs_on_cpu_with_tensor_parallelism():
    assert small("--sequence-parallel", "--tensor-model-parallel-size", "2").parallel.sequence_parallel
    cfg = small("--sequence-parallel")
    assert not cfg.parallel.sequence_parallel  # TP == 1: Megatron-LM drops it too, and says so
    assert any("--sequence-parallel has no effect" in line for line in cfg.notices)


def test_both_precisions():
    assert "pass one of them" in refused("--fp16", "--bf16", cuda_available=True)


def test_grad_reduce_in_bf16_needs_bf16():
    assert "needs --bf16" in refused("--grad-reduce-in-bf16")
    assert "needs --bf16" in refused("--fp16", "--grad-reduce-in-bf16")


def test_world_not_divisible_by_model_parallel():
    message = refused("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      world_size=6)
    assert "world size 6" in message and "multiple of 4" in message


def test_global_batch_not_divisible():
    message = refused("--global-batch-size", "10", world_size=4)  # mbs 2 x dp 4 = 8
    assert "--global-batch-size 10" in message and "multiple of 8" in message


def test_hidden_not_divisible_by_heads():
    argv = [a if a != "64" else "66" for a in SMALL]
    assert "--hidden-size 66 is not divisible by --num-attention-heads 4" in refused(argv=argv)


def test_heads_and_layers_against_tp_pp():
    assert "--tensor-model-parallel-size 8" in refused("--tensor-model-parallel-size", "8",
                                                       world_size=8)
    assert "--pipeline-model-parallel-size 4" in refused("--pipeline-model-parallel-size", "4",
                                                         world_size=4)


def test_seq_length_beyond_learned_positions():
    argv = SMALL + ["--seq-length", "64"]  # the later value wins, as in argparse
    assert "raise --max-position-embeddings" in refused(argv=argv)
    # RoPE has no position table: the same lengths are fine.
    cfg = parse_args(argv + ["--position-embedding-type", "rope"], world_size=4,
                     cuda_available=False)
    assert cfg.model.seq_length == 64


def test_swiglu_too_small_for_default_ffn():
    argv = [a if a != "64" else "16" for a in SMALL] + ["--swiglu"]
    assert "pass --ffn-hidden-size" in refused(argv=argv)


def test_overlap_grad_reduce_has_megatrons_meaning_under_recover():
    cfg = small("--recover", "--overlap-grad-reduce")
    assert cfg.parallel.overlap_grad_reduce
    assert not any("--overlap-grad-reduce" in n for n in cfg.notices)


def test_distributed_optimizer_under_recover_is_one_instance_per_replica():
    """--use-distributed-optimizer alone under --recover: every data-parallel rank is its own
    instance (replica), said at start-up; asking for one instance across replicas is refused."""
    cfg = small("--recover", "--use-distributed-optimizer", world_size=4)
    assert cfg.parallel.num_distributed_optimizer_instances == 4
    assert cfg.num_replicas == 4 and cfg.dp_ranks_per_replica == 1
    (line,) = [n for n in cfg.notices if "--use-distributed-optimizer" in n]
    assert "one optimizer instance per replica (--num-distributed-optimizer-instances 4)" in line
    assert "replicated, not sharded" in line
    message = refused("--recover", "--use-distributed-optimizer",
                      "--num-distributed-optimizer-instances", "1", world_size=4)
    assert "shards optimizer state across replicas" in message
    assert "or leave it out (one instance per replica)" in message
    # Without --recover, Megatron's meaning: one instance over the whole data-parallel group.
    assert small("--use-distributed-optimizer", world_size=4).num_replicas == 1
    # One data-parallel rank is one replica: nothing to lose across replicas, nothing to say.
    single = small("--recover", "--use-distributed-optimizer", world_size=1)
    assert single.num_replicas == 1 and not any("instance" in n for n in single.notices)


def test_expert_parallelism_under_recover_chooses_the_replica_layout():
    """--expert-model-parallel-size E with --use-distributed-optimizer under --recover and no
    instance count: DP / E instances of E data-parallel ranks, the smallest replica that holds
    an expert-parallel group, said at start-up; an explicit K keeps its meaning."""
    moe = ("--recover", "--num-experts", "4", "--expert-model-parallel-size", "2",
           "--use-distributed-optimizer")
    cfg = small(*moe, world_size=8)
    assert cfg.parallel.num_distributed_optimizer_instances == 4
    assert cfg.num_replicas == 4 and cfg.dp_ranks_per_replica == 2
    (line,) = [n for n in cfg.notices if "--use-distributed-optimizer under" in n]
    assert "--expert-model-parallel-size 2: 4 optimizer instances" in line
    assert "each a replica of 2 data-parallel ranks" in line
    assert line.endswith("pass --num-distributed-optimizer-instances 2")  # 1 spans replicas
    (line,) = [n for n in small(*moe, "--global-batch-size", "12", world_size=6).notices
               if "--use-distributed-optimizer" in n]
    assert line.endswith("hold complete copies)")  # 3 instances: no fewer that are 2 or more
    (layout,) = [n for n in cfg.notices if "mixture of experts" in n]
    assert "a distributed-optimizer instance of 2 data-parallel ranks" in layout
    assert "4 replicas reduce" in layout
    explicit = small(*moe, "--num-distributed-optimizer-instances", "2", world_size=8)
    assert explicit.num_replicas == 2 and explicit.dp_ranks_per_replica == 4
    assert not any("--use-distributed-optimizer under" in n for n in explicit.notices)
    # Megatron-LM's example (2 ranks, E 2) under --recover: one replica, nothing survives.
    message = refused(*moe, world_size=2)
    assert "they make 1 replica, which no failure leaves alive" in message
    assert "launch a multiple of 4 ranks" in message
    # 3 data-parallel ranks do not split into groups of 2: that one reason, not a replica count.
    message = refused(*moe, "--global-batch-size", "12", world_size=3)
    assert "not divisible by --expert-model-parallel-size 2" in message
    assert "replica, which no failure leaves alive" not in message
    # Without the distributed optimizer a replica of several data-parallel ranks has no name.
    message = refused(*moe[:-1], world_size=8)
    assert "add --use-distributed-optimizer" in message
    # Standbys are replicas of the same shape: E x TP x PP ranks each.
    from megatron_recover.megatron.config.arguments import training_world_size

    argv = _small_argv([*moe, "--recover-standby-replicas", "1"])
    assert training_world_size(argv, 10) == 8
    cfg = parse_args(argv, world_size=8, cuda_available=False)
    assert cfg.num_replicas == 4 and cfg.dp_ranks_per_replica == 2
    with pytest.raises(ValueError, match="a multiple of 2 ranks"):
        training_world_size(argv, 9)


def test_distributed_optimizer_instances_must_fit():
    assert "use a divisor of 4" in refused("--use-distributed-optimizer",
                                           "--num-distributed-optimizer-instances", "3")
    assert "needs --use-distributed-optimizer" in refused(
        "--num-distributed-optimizer-instances", "2")


def test_recover_options_without_recover():
    message = refused("--recover-policy", "adaptive", "--recover-log", "x.jsonl")
    assert "--recover-policy, --recover-log given without --recover" in message
    assert "add --recover" in message


def test_reserve_mode_needs_static_policy():
    message = refused("--recover", "--recover-policy", "adaptive", "--recover-mode", "reserve")
    assert "static policy only" in message


def test_failure_schedule_must_exist(tmp_path):
    assert "no such file" in refused("--recover", "--recover-failure-schedule",
                                     str(tmp_path / "missing.yaml"))
    schedule = tmp_path / "faults.yaml"
    schedule.write_text("entries: []\n")
    cfg = small("--recover", "--recover-failure-schedule", str(schedule))
    assert cfg.recover.failure_schedule == schedule


def test_warmup_iters_and_fraction_together():
    assert "keep one" in refused("--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1")


def test_warmup_longer_than_decay():
    assert "shorten the warmup" in refused("--lr-warmup-iters", "20")


def test_wsd_needs_its_decay_iters():
    assert "--lr-wsd-decay-iters" in refused("--lr-decay-style", "WSD")


def test_missing_required_arguments():
    message = refused(argv=["--mock-data", "--vocab-size", "10"])
    for flag in ("--num-layers", "--hidden-size", "--seq-length", "--train-iters", "--lr"):
        assert flag in message


def test_data_source_neither_or_both(gpt2_files):
    no_data = [a for a in SMALL if a != "--mock-data"]
    assert "pass --data-path PREFIX" in refused(argv=no_data)
    assert "pass one of them" in refused("--data-path", gpt2_files["prefix"])


def test_data_blends_read_as_megatron_core_reads_them(gpt2_files, tmp_path):
    no_data = [a for a in SMALL if a != "--mock-data"]
    prefix = gpt2_files["prefix"]

    def blend(*words):
        return parse_args(no_data + ["--data-path", *words], world_size=4,
                          cuda_available=False).data.blend

    assert blend("1.0", prefix) == ((prefix,), (1.0,))  # a weighted blend of one, as megatron
    assert blend("0.3", prefix, "0.7", prefix) == ((prefix, prefix), (0.3, 0.7))
    assert blend(prefix, prefix) == ((prefix, prefix), None)
    args = tmp_path / "blend.txt"
    args.write_text(f"0.25 {prefix}\n0.75 {prefix}\n")
    cfg = parse_args(no_data + ["--data-args-path", str(args)], world_size=4, cuda_available=False)
    assert cfg.data.blend == ((prefix, prefix), (0.25, 0.75))
    assert "--data-path and --data-args-path were both given" in refused(
        argv=no_data + ["--data-path", prefix, "--data-args-path", str(args)])
    assert "no such file" in refused(argv=no_data + ["--data-args-path", str(tmp_path / "none")])
    assert "0.7 in the place of a prefix" in refused(argv=no_data + ["--data-path", "0.3",
                                                                     prefix, "0.7"])
    assert "0.5 in the place of a prefix" in refused(argv=no_data + ["--data-path", "0.5",
                                                                     prefix, prefix, "0.5"])
    assert "must be >= 0 and not all 0" in refused(argv=no_data + ["--data-path", "-1", prefix,
                                                                   "2", prefix])
    message = refused(argv=no_data + ["--data-path", "0.5", prefix, "0.5", str(tmp_path / "x")])
    assert f"--data-path {tmp_path / 'x'}: {tmp_path / 'x'}.bin" in message


def test_per_split_data_read_as_megatron_lm_reads_them(gpt2_files, tmp_path):
    no_data = [a for a in SMALL if a != "--mock-data"]
    prefix = gpt2_files["prefix"]
    cfg = parse_args(no_data + ["--train-data-path", "0.5", prefix, "0.5", prefix,
                                "--valid-data-path", prefix], world_size=4, cuda_available=False)
    assert cfg.data.blend is None and cfg.data.split is None
    assert cfg.data.blend_per_split == (((prefix, prefix), (0.5, 0.5)), ((prefix,), None), None)
    per_split = tmp_path / "splits.json"
    per_split.write_text(json.dumps({"train": f"1 {prefix}", "valid": [prefix], "test": None}))
    cfg = parse_args(no_data + ["--per-split-data-args-path", str(per_split)], world_size=4,
                     cuda_available=False)
    assert cfg.data.blend_per_split == (((prefix,), (1.0,)), ((prefix,), None), None)
    assert "without a training blend" in refused(argv=no_data + ["--valid-data-path", prefix])
    assert "drop --split" in refused(argv=no_data + ["--train-data-path", prefix,
                                                     "--split", "90,5,5"])
    assert "were both given" in refused(argv=no_data + ["--train-data-path", prefix,
                                                        "--data-path", prefix])
    per_split.write_text("[1, 2]")
    assert "a JSON object with" in refused(argv=no_data + ["--per-split-data-args-path",
                                                           str(per_split)])


def test_missing_dataset_files(gpt2_files):
    no_data = [a for a in SMALL if a != "--mock-data"]
    message = refused(argv=no_data + ["--data-path", gpt2_files["prefix"] + ".bin"])
    assert "not found" in message and f"--data-path {gpt2_files['prefix']}" in message


def test_bad_split(gpt2_files):
    no_data = [a for a in SMALL if a != "--mock-data"]
    argv = no_data + ["--data-path", gpt2_files["prefix"], "--split", "0,50,50"]
    assert "positive train share" in refused(argv=argv)


def test_tokenizer_files(gpt2_files, tmp_path):
    base = [a for a in SMALL if a not in ("--tokenizer-type", "NullTokenizer")]
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer"]
    assert "needs --merge-file" in refused(argv=base + gpt2 + ["--vocab-file", gpt2_files["vocab"]])
    missing = str(tmp_path / "nope.json")
    message = refused(argv=base + gpt2 + ["--vocab-file", missing,
                                          "--merge-file", gpt2_files["merges"]])
    assert f"--vocab-file {missing}: no such file" in message
    assert "needs --tokenizer-model" in refused(argv=base + ["--tokenizer-type",
                                                             "HuggingFaceTokenizer"])
    assert "use one of GPT2BPETokenizer" in refused(argv=base + ["--tokenizer-type",
                                                                 "BertWordPieceCase"])
    # --vocab-size (in `base`) is read by NullTokenizer and TikTokenizer only.
    assert ("--vocab-size: --tokenizer-type GPT2BPETokenizer takes its vocabulary from its "
            "files: drop it") in refused(argv=base + gpt2 + ["--vocab-file", gpt2_files["vocab"],
                                                             "--merge-file", gpt2_files["merges"]])
    no_tokenizer = [a for a in base if a not in ("--vocab-size", "100")]
    assert "no tokenizer" in refused(argv=no_tokenizer)


def test_save_needs_interval(tmp_path):
    assert "--save needs --save-interval" in refused("--save", str(tmp_path))


def test_every_problem_in_one_message():
    message = refused("--gradient-accumulation-fusion", "--context-parallel-size", "2",
                      "--recover-mode", "exact", "--fp8-format", "hybrid")
    assert "--gradient-accumulation-fusion" in message and "--context-parallel-size" in message
    assert "without --recover" in message and "--fp8-format" in message
    assert len(message.splitlines()) == 5  # a header and one line per problem


# --------------------------------------------------------------------------------------------
# Ignored and unknown arguments
# --------------------------------------------------------------------------------------------


def test_no_effect_arguments_named_once_per_reason_in_order():
    cfg = small("--distributed-timeout-minutes", "5", "--no-masked-softmax-fusion",
                "--log-params-norm", "--timing-log-level", "2",
                "--no-bias-dropout-fusion", "--distributed-timeout-minutes", "7",
                "--profile-ranks", "0", "1", "--num-workers", "4")
    lines = [line for line in cfg.notices if "no effect here" in line]
    assert [line.split(": ")[2] for line in lines] == [
        "--distributed-timeout-minutes", "--no-masked-softmax-fusion --no-bias-dropout-fusion",
        "--log-params-norm --timing-log-level", "--profile-ranks", "--num-workers"]
    assert "rendezvous, ranks and timeouts come from MPI" in lines[0]


def test_wandb_without_the_package_is_refused_and_logging_flags_parse():
    with pytest.raises(ValueError, match="--wandb-project proj: the wandb package is not "
                       "installed here"):
        small("--wandb-project=proj")
    cfg = small("--log-throughput", "--eval-interval", "5", "--eval-iters", "2",
                "--no-log-loss-scale-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                "--exit-interval", "7", "--exit-signal-handler", "--exit-signal", "SIGUSR1")
    assert cfg.logging.log_throughput and not cfg.logging.log_loss_scale
    assert cfg.logging.log_validation_ppl and not cfg.notices[1:]
    assert (cfg.evaluation.interval, cfg.evaluation.iters) == (5, 2)
    assert cfg.exit.interval == 7 and cfg.exit.signal_handler and cfg.exit.signal == "SIGUSR1"
    with pytest.raises(ValueError, match="--eval-iters must be >= 0"):
        small("--eval-iters", "-1")


def test_zero_turns_the_eval_and_exit_intervals_off_as_in_megatron_lm():
    # Megatron-LM core_v0.16.1 tests `if args.eval_interval and ...` (its default is None), and
    # likewise --exit-interval and --exit-duration-in-mins.
    assert small().evaluation.interval is None
    cfg = small("--eval-interval", "0", "--exit-interval", "0", "--exit-duration-in-mins", "0")
    assert cfg.evaluation.interval is None and not cfg.evaluation.due(1000)
    assert (cfg.exit.interval, cfg.exit.duration_mins, cfg.exit.agreed) == (None, None, False)
    assert small("--exit-duration-in-mins", "0.5").exit.duration_mins == 0.5
    for flag in ("--eval-interval", "--exit-interval", "--exit-duration-in-mins"):
        with pytest.raises(ValueError, match=f"{flag} must be >= 0 \\(0: off\\), got -1"):
            small(flag, "-1")


def test_exit_signal_takes_any_catchable_signal_name():
    assert small("--exit-signal-handler", "--exit-signal", "SIGHUP").exit.signal == "SIGHUP"
    with pytest.raises(ValueError, match="--exit-signal SIGKILL: no process can catch it"):
        small("--exit-signal-handler", "--exit-signal", "SIGKILL")


def test_unknown_argument_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        small("--no-such-flag")
    assert info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_no_abbreviations(capsys):
    # "--recover-p" would be an abbreviation of --recover-policy if argparse allowed them.
    with pytest.raises(SystemExit):
        small("--recover", "--recover-p", "static")
    assert "unrecognized arguments" in capsys.readouterr().err


def test_bad_choice_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        small("--lr-decay-style", "step")
    assert "invalid choice" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# megatron-core config objects
# --------------------------------------------------------------------------------------------


def test_transformer_config_on_cpu():
    cfg = small("--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                "--hidden-dropout", "0.2", "--attention-dropout", "0.05",
                "--init-method-std", "0.01", "--group-query-attention", "--num-query-groups", "2",
                "--pipeline-model-parallel-size", "2", "--use-cpu-initialization")
    tc = to_transformer_config(cfg)
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads) == (2, 64, 4)
    assert tc.ffn_hidden_size == cfg.model.ffn_hidden_size == 128  # int(170.67/64)*64
    assert tc.gated_linear_unit and tc.activation_func is F.silu
    assert tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-5
    assert not tc.add_bias_linear and not tc.add_qkv_bias
    assert (tc.hidden_dropout, tc.attention_dropout, tc.init_method_std) == (0.2, 0.05, 0.01)
    assert tc.num_query_groups == 2 and tc.kv_channels == 16
    assert tc.pipeline_model_parallel_size == 2 and tc.use_cpu_initialization
    assert tc.params_dtype == torch.float32 and tc.pipeline_dtype == torch.float32
    assert not (tc.bias_dropout_fusion or tc.masked_softmax_fusion or tc.bias_activation_fusion
                or tc.apply_rope_fusion or tc.persist_layer_norm
                or tc.gradient_accumulation_fusion)
    assert not tc.bf16 and not tc.fp16 and not tc.attention_softmax_in_fp32

    gelu = to_transformer_config(small())
    assert gelu.activation_func is F.gelu and not gelu.gated_linear_unit
    assert gelu.add_bias_linear and gelu.add_qkv_bias  # kept in step, as Megatron-LM does


def test_llama_style_options_reach_megatron_core():
    cfg = small("--kv-channels", "32", "--apply-layernorm-1p", "--qk-layernorm",
                "--recompute-granularity", "full", "--recompute-method", "block",
                "--recompute-num-layers", "2", "--cross-entropy-loss-fusion",
                "--attention-backend", "unfused", "--no-create-attention-mask-in-dataloader",
                "--decoupled-lr", "5e-4", "--decoupled-min-lr", "4.5e-5",
                "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.01",
                "--end-weight-decay", "0.1")
    tc = to_transformer_config(cfg)
    assert tc.kv_channels == 32 and tc.layernorm_zero_centered_gamma and tc.qk_layernorm
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == (
        "full", "block", 2)
    assert not tc.cross_entropy_loss_fusion  # CPU: the unfused loss, said at start-up
    assert any("--cross-entropy-loss-fusion: the fused kernel is CUDA-only" in line
               for line in cfg.notices)
    assert tc.attention_backend.name == "auto"  # local spec: megatron-core's attention, said so
    assert any("--attention-backend unfused has no effect" in line for line in cfg.notices)
    assert not cfg.data.create_attention_mask
    oc = to_optimizer_config(cfg)
    assert (oc.decoupled_lr, oc.decoupled_min_lr) == (5e-4, 4.5e-5)
    kwargs = to_scheduler_kwargs(cfg)
    assert (kwargs["start_wd"], kwargs["end_wd"], kwargs["wd_incr_style"]) == (0.01, 0.1, "linear")
    assert small("--recompute-activations").model.recompute_granularity == "selective"


@pytest.mark.parametrize("extra, expected", [
    (["--recompute-granularity", "full"], ["needs --recompute-method", "--recompute-num-layers"]),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "3"], ["between 1 and the 2 layers"]),
    (["--recompute-method", "block"], ["--recompute-method apply to --recompute-granularity full"]),
    (["--recompute-activations", "--recompute-granularity", "full"], ["means"]),
    (["--start-weight-decay", "0.1"], ["--weight-decay-incr-style linear or cosine"]),
    (["--weight-decay-incr-style", "cosine"], ["needs --start-weight-decay and --end-weight"]),
    (["--decoupled-min-lr", "1e-5"], ["add --decoupled-lr"]),
    (["--ckpt-format", "torch"], ["--ckpt-format torch_dist"]),
    (["--hidden-size", "66"], ["or pass --kv-channels"]),
])
def test_model_option_rules(extra, expected):
    message = refused(*extra)
    for text in expected:
        assert text in message, (text, message)


def test_kv_channels_frees_the_head_size():
    assert small("--hidden-size", "66", "--kv-channels", "16").model.kv_channels == 16


def test_transformer_config_bf16_on_cuda():
    tc = to_transformer_config(small("--bf16", "--attention-softmax-in-fp32",
                                     cuda_available=True))
    assert tc.bf16 and tc.params_dtype == torch.bfloat16 and tc.pipeline_dtype == torch.bfloat16
    assert tc.gradient_accumulation_fusion and tc.attention_softmax_in_fp32


def test_ddp_config():
    ddp = to_ddp_config(small("--overlap-grad-reduce", "--ddp-bucket-size", "1000",
                              "--use-distributed-optimizer",
                              "--num-distributed-optimizer-instances", "2", world_size=4))
    assert ddp.overlap_grad_reduce and ddp.bucket_size == 1000
    assert ddp.use_distributed_optimizer and ddp.num_distributed_optimizer_instances == 2
    assert not ddp.grad_reduce_in_fp32
    # As Megatron-LM's validate_args: bf16 gradients are accumulated and reduced in fp32 unless
    # --grad-reduce-in-bf16; fp16 only with --accumulate-allreduce-grads-in-fp32.
    assert to_ddp_config(small("--bf16")).grad_reduce_in_fp32
    assert not to_ddp_config(small("--bf16", "--grad-reduce-in-bf16")).grad_reduce_in_fp32
    assert not to_ddp_config(small("--fp16")).grad_reduce_in_fp32
    fp32_grads = small("--fp16", "--accumulate-allreduce-grads-in-fp32")
    assert to_ddp_config(fp32_grads).grad_reduce_in_fp32


def test_precision_startup_line():
    assert small("--bf16").precision.describe() == (
        "bf16 parameters (fp32 main copy in the optimizer), gradients accumulated and reduced "
        "in fp32")
    assert "reduced in bf16" in small("--bf16", "--grad-reduce-in-bf16").precision.describe()
    assert small("--fp16", "--initial-loss-scale", "4096").precision.describe().endswith(
        "reduced in fp16, dynamic loss scale from 4096")
    assert small().precision.describe() == (
        "fp32 parameters, gradients accumulated and reduced in fp32")


def test_optimizer_config():
    oc = to_optimizer_config(small("--weight-decay", "0.1", "--adam-beta2", "0.95",
                                   "--adam-eps", "1e-6", "--clip-grad", "0.5", "--min-lr", "1e-5",
                                   "--fp16", "--loss-scale", "1024", cuda_available=True))
    assert oc.optimizer == "adam" and oc.lr == 1e-3 and oc.min_lr == 1e-5
    assert (oc.weight_decay, oc.adam_beta1, oc.adam_beta2, oc.adam_eps) == (0.1, 0.9, 0.95, 1e-6)
    assert oc.clip_grad == 0.5 and oc.fp16 and not oc.bf16 and oc.loss_scale == 1024
    assert oc.params_dtype == torch.float16 and not oc.use_distributed_optimizer


class _Optimizer:
    """What OptimizerParamScheduler touches: param_groups."""

    def __init__(self):
        self.param_groups = [{}]


def test_scheduler_follows_megatron_steps():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg = small("--lr-warmup-iters", "4", "--lr-decay-style", "cosine", "--min-lr", "1e-4")
    kwargs = to_scheduler_kwargs(cfg)
    gbs = cfg.global_batch_size
    assert kwargs["lr_warmup_steps"] == 4 * gbs and kwargs["lr_decay_steps"] == 20 * gbs
    optimizer = _Optimizer()
    scheduler = OptimizerParamScheduler(optimizer, **kwargs)
    lrs = []
    for _ in range(cfg.train_iters):
        scheduler.step(increment=gbs)  # once per iteration, by the global batch in samples
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(1e-3 / 4) and lrs[3] == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert optimizer.param_groups[0]["weight_decay"] == 0.01

    # A warmup fraction is applied to the decay steps in samples, in Megatron's order.
    frac = to_scheduler_kwargs(small("--lr-warmup-fraction", "0.1", "--lr-decay-iters", "7"))
    assert frac["lr_warmup_steps"] == 0.1 * (7 * gbs)

    wsd = small("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5")
    scheduler = OptimizerParamScheduler(_Optimizer(), **to_scheduler_kwargs(wsd))
    assert scheduler.wsd_decay_steps == 5 * gbs


def test_policy_config():
    cfg = small("--recover", "--use-distributed-optimizer",
                "--num-distributed-optimizer-instances", "2", world_size=4)
    policy = to_policy_config(cfg)
    assert (policy.w_init, policy.g_init) == (2, 4)
    assert policy.b == cfg.b == 8 and policy.policy == "static" and policy.mode == "exact"
    assert math.prod((cfg.num_replicas, cfg.num_microbatches_per_replica)) == cfg.b


def test_standby_replicas_are_outside_the_world_size():
    """-np 6 with 2 standbys: 4 training ranks decide DP and B, the standbys are counted apart."""
    from megatron_recover.megatron.config.arguments import training_world_size

    argv = _small_argv(["--recover", "--recover-standby-replicas", "2"])
    assert training_world_size(argv, 6) == 4
    assert training_world_size(_small_argv([]), 6) == 6
    tp2 = _small_argv(["--recover", "--recover-standby-replicas", "1",
                       "--tensor-model-parallel-size", "2"])
    assert training_world_size(tp2, 6) == 4  # one standby replica of TP x PP = 2 ranks
    cfg = parse_args(argv, world_size=training_world_size(argv, 6), cuda_available=False)
    assert (cfg.parallel.world_size, cfg.num_replicas, cfg.recover.standby_replicas) == (4, 4, 2)
    assert cfg.b == 8
    cfg = parse_args(tp2, world_size=training_world_size(tp2, 6), cuda_available=False)
    assert (cfg.parallel.world_size, cfg.num_replicas, cfg.parallel.ranks_per_replica) == (4, 2, 2)
    # A standby replica is an instance of the same shape: 2 instances of 2 shards (4 ranks) and
    # one standby instance of 2 (-np 6); with TP=2, 2 instances of 2 x 2 and one more (-np 12).
    hsdp = _small_argv(["--recover", "--recover-standby-replicas", "1",
                        "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"])
    assert training_world_size(hsdp, 6) == 4
    assert training_world_size([*hsdp, "--tensor-model-parallel-size", "2"], 12) == 8
    cfg = parse_args(hsdp, world_size=training_world_size(hsdp, 6), cuda_available=False)
    assert (cfg.parallel.world_size, cfg.num_replicas, cfg.parallel.ranks_per_replica) == (4, 2, 2)
    # --use-distributed-optimizer alone under --recover: an instance per data-parallel rank.
    alone = _small_argv(["--recover", "--recover-standby-replicas", "2",
                         "--use-distributed-optimizer"])
    assert training_world_size(alone, 6) == 4
    with pytest.raises(ValueError, match="a multiple of 3"):
        training_world_size(hsdp, 7)  # 2 instances + 1 standby instance of equal size


def test_standby_replicas_refusals():
    assert "given without --recover" in refused("--recover-standby-replicas", "1")
    assert "must be >= 0" in refused("--recover", "--recover-standby-replicas", "-1")
    # -np 4 with 4 standbys: nothing left to train.
    assert "no training ranks" in refused("--recover", "--recover-standby-replicas", "4",
                                          world_size=0)


def test_the_data_plane_default_and_its_refusals():
    """--recover-data-plane (docs/data-planes.md): torch where torch reconfigures groups (the
    pinned 2.14.1 does) and NCCL can form the group; mpi where it cannot, or when asked."""
    assert small("--recover").recover.data_plane == "torch"
    assert small("--recover", cuda_available=True).recover.data_plane == "torch"
    assert small("--recover", "--recover-data-plane", "mpi").recover.data_plane == "mpi"
    assert small("--recover", "--recover-ranks-per-device", "2",
                 cuda_available=True).recover.data_plane == "mpi"
    assert small("--recover", "--recover-cuda-aware-mpi",
                 cuda_available=True).recover.data_plane == "mpi"
    assert "two ranks on one GPU, which NCCL refuses" in refused(
        "--recover", "--recover-data-plane", "torch", "--recover-ranks-per-device", "2",
        cuda_available=True)
    assert "the torch plane moves them with NCCL" in refused(
        "--recover", "--recover-data-plane", "torch", "--recover-cuda-aware-mpi",
        cuda_available=True)
    assert "--recover-data-plane given without --recover" in refused("--recover-data-plane",
                                                                     "mpi")
