"""What a run loads at start-up: Megatron-LM's load flags, resolved once for both checkpoint
formats (`dist_checkpoint` for stock runs, `checkpoint` under --recover).

Megatron-LM's meanings (megatron/training/checkpointing.py, load_checkpoint):

- `--load DIR`: the newest checkpoint its tracker names; none (no tracker) starts from scratch,
  so a job script passes the same `--save`/`--load` on every launch.
- `--exit-on-missing-checkpoint`: `--load` without a checkpoint stops instead.
- `--pretrained-checkpoint DIR`: when `--load` holds no checkpoint, load DIR's newest with
  `--finetune`'s meaning (and stop if DIR holds none either).
- `--finetune`: the model only, and the run starts at iteration 1 with a fresh optimizer,
  scheduler and generators (and its data from the start).
- `--no-load-optim`: the model, iteration and generators, not the optimizer or the scheduler
  (whose step count starts again).
- `--no-load-rng`: everything but the random number generators.
- `--ckpt-step N`: checkpoint N instead of the one the tracker names.
"""

from dataclasses import dataclass
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class LoadPlan:
    """One checkpoint to load, and which of its parts."""

    directory: Path
    iteration: int  # the checkpoint's iteration (its iter_NNNNNNN directory)
    finetune: bool  # the model only; the run starts at iteration 1
    optimizer: bool  # the optimizer and the scheduler
    rng: bool

    @property
    def path(self) -> Path:
        return iteration_dir(self.directory, self.iteration)

    @property
    def resumes(self) -> bool:
        """Whether the run continues the checkpoint's iteration (not a fine-tune)."""
        return not self.finetune


def iteration_dir(directory, iteration: int) -> Path:
    """Megatron's directory of one checkpoint: DIR/iter_NNNNNNN."""
    return Path(directory) / f"iter_{iteration:07d}"


def tracked_iteration(directory) -> int | None:
    """The iteration `directory`'s tracker names, or None without a tracker."""
    tracker = Path(directory) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        raise ValueError(f"--load: {tracker} names a release checkpoint (Megatron-LM's converted "
                         "checkpoints, in DIR/release), which is not supported here: load a "
                         "checkpoint of an iteration")
    if not text.isdigit():
        raise ValueError(f"--load: {tracker} holds {text!r}, not an iteration number")
    return int(text)


def printer(rank: int):
    """How `plan` speaks on `rank`: rank 0 prints (flushed), the others say nothing."""
    if rank != 0:
        return lambda line: None
    return lambda line: print(line, flush=True)


def plan(checkpoint, say=print) -> LoadPlan | None:
    """What `checkpoint` (a CheckpointConfig) asks to load, or None: start from scratch.
    Raises ValueError when the flags ask for a checkpoint that is not there. `say` prints the
    lines Megatron-LM prints about the choice (rank 0's)."""
    directory = Path(checkpoint.load) if checkpoint.load else None
    found = tracked_iteration(directory) if directory else None
    finetune = checkpoint.finetune
    if found is None and checkpoint.pretrained_checkpoint:
        say(f"megatron-recover: no checkpoint in --load {directory}: fine-tuning from "
            f"--pretrained-checkpoint {checkpoint.pretrained_checkpoint}")
        directory = Path(checkpoint.pretrained_checkpoint)
        found = tracked_iteration(directory)
        if found is None:
            raise ValueError(f"--pretrained-checkpoint {directory}: no checkpoint there (no "
                             f"{TRACKER}), nor in --load {checkpoint.load}")
        finetune = True
    if found is None:
        if directory is not None and checkpoint.exit_on_missing_checkpoint:
            raise ValueError(f"--exit-on-missing-checkpoint: --load {directory} holds no "
                             f"checkpoint (no {TRACKER}); check the path, or drop the flag to "
                             "start from scratch")
        return None
    iteration = found if checkpoint.ckpt_step is None else checkpoint.ckpt_step
    result = LoadPlan(directory, iteration, finetune,
                      optimizer=not finetune and checkpoint.load_optim,
                      rng=not finetune and checkpoint.load_rng)
    if not result.path.is_dir():
        raise ValueError(f"--ckpt-step {iteration}: {directory} has no {result.path.name}"
                         if checkpoint.ckpt_step is not None else
                         f"--load: {TRACKER} in {directory} names iteration {iteration}, but "
                         f"{result.path} is missing")
    return result


def model_mismatch(path, error: Exception) -> str:
    """What to say when a checkpoint's model does not fit this run's: the loader's first line
    about it (a size mismatch names the tensor and both shapes)."""
    # Errors gathered from other ranks carry their tracebacks: the source lines are not it.
    lines = [line.strip() for line in str(error).splitlines()
             if line.strip() and not line.strip().startswith(("raise ", "File "))]
    detail = next((line for line in lines if "mismatch" in line or "Missing" in line
                   or "Unexpected" in line), lines[0] if lines else type(error).__name__)
    return (f"--load: the model in {path} does not match this run's ({detail}); load it with "
            "the model arguments it was written with (--num-layers, --hidden-size, "
            "--vocab-size or the tokenizer, ...)")


def load_optimizer_state(optimizer, state: dict, path) -> None:
    """`optimizer.load_state_dict(state)`, with the one error a user can fix said plainly.

    megatron-core 0.19 matches a checkpoint's parameter groups to this run's by their learning
    and weight-decay settings (`max_lr`, `min_lr`, `start_wd`, `end_wd`, ...; its
    `param_group_identifier_keys`): a run resumed with another --lr, --min-lr, --decoupled-lr or
    weight decay finds no group to load into, and the distributed optimizer raises a bare
    KeyError. megatron-core 0.16.1 loaded such a checkpoint and kept its old rates.
    """
    try:
        optimizer.load_state_dict(state)
    except (KeyError, ValueError) as error:
        if not isinstance(error, KeyError) and "parameter group" not in str(error):
            raise
        raise ValueError(
            f"--load: the optimizer state in {path} has parameter groups with other learning-"
            "rate or weight-decay settings than this run's (megatron-core matches them on "
            "max_lr, min_lr, start_wd, end_wd): resume with the --lr, --min-lr, --decoupled-lr, "
            "--decoupled-min-lr, --weight-decay, --start-weight-decay and --end-weight-decay "
            "it was saved with, or load the model alone with --no-load-optim") from error
