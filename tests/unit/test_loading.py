"""Megatron-LM's load flags resolved into one plan (`megatron_recover.megatron.loading`).

Run: .venv/bin/python -m pytest tests/unit/test_loading.py   (no MPI; seconds)
"""

from dataclasses import replace
from pathlib import Path

import pytest

from megatron_recover.megatron.config import CheckpointConfig
from megatron_recover.megatron.loading import TRACKER, LoadPlan, plan

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
    (torn / TRACKER).write_text("release\n")
    with pytest.raises(ValueError, match="holds 'release', not an iteration number"):
        plan(flags(load=str(torn)))
