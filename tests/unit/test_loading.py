"""Megatron-LM's load flags resolved into one plan (`megatron_recover.megatron.persistence.loading`).

Run: .venv/bin/python -m pytest tests/unit/test_loading.py   (no MPI; seconds)
"""

from dataclasses import replace
from pathlib import Path

import pytest

from megatron_recover.megatron.config.train_config import CheckpointConfig
from megatron_recover.megatron.persistence.loading import TRACKER, LoadPlan, plan

pytestmark = pytest.mark.unit


def checkpoint_dir(root: Path, name: str, iterations=(2, 4), tracked=4) -> Path:
    directory = root / name
    for iteration in iterations:
        (directory / f"iter_{iteration:07d}").mkdir(parents=True)
    if tracked is not None:
        (directory / TRACKER).write_text(f"{tracked}\n")
    return directory


def flags(**kwargs) -> CheckpointConfig:
    return replace(CheckpointConfig(save=None, load=None, save_interval=None), **kwargs)


def test_load_resumes_the_tracked_checkpoint_whole(tmp_path):
    d = checkpoint_dir(tmp_path, "d")
    assert plan(flags(load=str(d))) == LoadPlan(d, 4, finetune=False, optimizer=True, rng=True)
    assert plan(flags()) is None  # no --load
    assert plan(flags(load=str(tmp_path / "empty"))) is None  # a job script's first launch


def test_flags_leave_out_what_megatron_lm_leaves_out(tmp_path):
    d = str(checkpoint_dir(tmp_path, "d"))
    assert plan(flags(load=d, load_optim=False)).optimizer is False
    assert plan(flags(load=d, load_rng=False)).rng is False
    tuned = plan(flags(load=d, finetune=True))
    assert (tuned.finetune, tuned.optimizer, tuned.rng, tuned.resumes) == (True, False, False,
                                                                           False)
    assert plan(flags(load=d, ckpt_step=2)).iteration == 2


def test_pretrained_checkpoint_only_when_load_holds_none(tmp_path):
    pretrained = checkpoint_dir(tmp_path, "pretrained", iterations=(8,), tracked=8)
    lines = []
    got = plan(flags(load=str(tmp_path / "empty"), pretrained_checkpoint=str(pretrained)),
               say=lines.append)
    assert got == LoadPlan(pretrained, 8, finetune=True, optimizer=False, rng=False)
    assert "fine-tuning from --pretrained-checkpoint" in lines[0]
    # A checkpoint in --load wins: the fine-tune's own relaunch resumes it.
    own = checkpoint_dir(tmp_path, "own")
    assert plan(flags(load=str(own), pretrained_checkpoint=str(pretrained))).directory == own
    with pytest.raises(ValueError, match="no checkpoint there"):
        plan(flags(load=str(tmp_path / "empty"), pretrained_checkpoint=str(tmp_path / "none")))


def test_what_is_asked_for_and_missing_stops(tmp_path):
    with pytest.raises(ValueError, match="--exit-on-missing-checkpoint: --load .* holds no"):
        plan(flags(load=str(tmp_path / "empty"), exit_on_missing_checkpoint=True))
    d = str(checkpoint_dir(tmp_path, "d"))
    with pytest.raises(ValueError, match="--ckpt-step 3: .* has no iter_0000003"):
        plan(flags(load=d, ckpt_step=3))
    stale = str(checkpoint_dir(tmp_path, "stale", iterations=(2,), tracked=4))
    with pytest.raises(ValueError, match="names iteration 4, but .*iter_0000004 is missing"):
        plan(flags(load=stale))
    torn = checkpoint_dir(tmp_path, "torn", tracked=None)
    (torn / TRACKER).write_text("latest\n")
    with pytest.raises(ValueError, match="holds 'latest', not an iteration number"):
        plan(flags(load=str(torn)))
    (torn / TRACKER).write_text("release\n")
    with pytest.raises(ValueError, match="names a release checkpoint"):
        plan(flags(load=str(torn)))


# What Megatron-LM's load_checkpoint and check_checkpoint_args (megatron/training/checkpointing.py
# at core_v0.16.1) read from a checkpoint's `args`, docs/checkpoints.md.
MEGATRON_LM_READS = {
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size",
    "data_parallel_size", "no_save_rng", "no_save_optim", "ckpt_fully_parallel_save",
    "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples", "num_layers",
    "hidden_size", "num_attention_heads", "add_position_embedding", "max_position_embeddings",
    "make_vocab_size_divisible_by", "tokenizer_type", "padded_vocab_size",
    "data_parallel_random_init", "vocab_file"}


def test_the_common_state_holds_what_megatron_lms_loader_reads():
    import argparse

    from megatron_recover.megatron.config.arguments import parse_args
    from megatron_recover.megatron.persistence.common import check_data_position, megatron_common

    cfg = parse_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                     "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 8 "
                     "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 100 "
                     "--tensor-model-parallel-size 2 --eval-interval 2 --eval-iters 3".split(),
                     world_size=4, cuda_available=False)
    common = megatron_common(cfg, 5, padded_vocab_size=128)
    assert set(common) == {"args", "checkpoint_version", "num_floating_point_operations_so_far"}
    assert common["checkpoint_version"] == 3.0
    args = common["args"]
    assert isinstance(args, argparse.Namespace) and MEGATRON_LM_READS <= set(vars(args))
    # 5 iterations of 8 samples; evaluations after iterations 2 and 4, of 3 x 8 samples each.
    assert (args.consumed_train_samples, args.consumed_valid_samples) == (40, 48)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.data_parallel_size, args.world_size) == (2, 1, 2, 4)
    assert (args.num_layers, args.hidden_size, args.padded_vocab_size) == (2, 64, 128)
    assert args.add_position_embedding  # megatron's default, learned absolute positions
    # Megatron-LM's model FLOPs of 40 samples: 12 x samples x s x layers x h^2 x (attention +
    # MLP + logits) = 12 * 40 * 32 * 2 * 64^2 * ((1 + 1 + 32/128) + 4 + 128/256).
    assert common["num_floating_point_operations_so_far"] == 12 * 40 * 32 * 2 * 64 ** 2 * 6.75
    check_data_position(args, 5, cfg)
    with pytest.raises(ValueError, match="consumed 40 training samples by iteration 6, while "
                                         "this run's batch sizes give 48"):
        check_data_position(args, 6, cfg)
