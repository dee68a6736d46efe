"""--recover's `--ckpt-format torch`: Megatron-LM's per-rank torch files, written after failures
and resumed on fewer replicas; and the recovery state every --recover checkpoint carries.

Two formats, as Megatron-LM's --ckpt-format: torch_dist (the default; `dist_checkpoint.py`
writes and reads it, and it is the format stock runs use) and torch, this module's files, in
Megatron-LM's layout (megatron/training/checkpointing.py at core_v0.16.1):

  SAVE/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt   one (tensor, pipeline) position:
      Megatron-LM's keys (`checkpoint_common.megatron_common`: args, checkpoint_version, the
      FLOPs counter; iteration, model, optimizer, opt_param_scheduler, rng_state) and the
      recovery state (`recover_state`: B, W_init, G_init, policy, mode, the policy layout,
      reserve pointer)
  SAVE/iter_NNNNNNN/mp_rank_TT[_PPP]/distrib_optim_shard_SS.pt   with the distributed
      optimizer, each shard's main parameters and Adam moments (its state_dict leaves them out;
      Megatron-LM gathers them into one distrib_optim.pt instead, which is not read here)
  SAVE/iter_NNNNNNN/recover_state.json   the recovery state, for people
  SAVE/latest_checkpointed_iteration.txt   the newest complete one

Writing uses only groups without dead ranks: the lowest live replica (by the policy, which every
rank agrees on) writes its positions' files, its ranks meet in a barrier on their own
intra-replica group, and its local rank 0 then moves the tracker. No world-wide gather or
barrier, so a dead replica 0 leaves nothing unwritten. Replicas hold identical states, so any
live replica's files are the checkpoint.
"""

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_recover.megatron import checkpoint_common, loading
from megatron_recover.megatron import state as training_state
from megatron_recover.policy import ADAPTIVE, Layout
from megatron_recover.policy.adaptive import AdaptiveLayout

TRACKER = loading.TRACKER


@dataclass
class RecoveryState:
    """What the policy needs to continue a run."""

    iteration: int
    b: int
    w_init: int
    g_init: int
    policy: str
    mode: str
    layout: object
    reserve_next: int
    live_replicas: tuple[int, ...]
    ramp: tuple[int, ...] = ()  # B of each ramp-up iteration (--rampup-batch-size)

    def to_dict(self) -> dict:
        """Plain values only (a torch_dist checkpoint's common state is read with torch.load's
        weights_only): the layout as its fields."""
        return {**asdict(self), "layout": asdict(self.layout)}

    @classmethod
    def from_dict(cls, saved: dict) -> "RecoveryState":
        layout_type = AdaptiveLayout if saved["policy"] == ADAPTIVE else Layout
        return cls(**{**saved, "layout": layout_type(**saved["layout"])})


MODEL_FILE = "model_optim_rng.pt"


def position_dir(position: tuple[int, ...], pipeline_size: int) -> str:
    """Megatron-LM's directory of a (tensor, pipeline) position: mp_rank_TT, or mp_rank_TT_PPP
    with pipeline parallelism."""
    name = f"mp_rank_{position[0]:02d}"
    return name + f"_{position[1]:03d}" if pipeline_size > 1 else name


def _files(directory, iteration: int, position: tuple[int, ...],
           pipeline_size: int) -> tuple[Path, Path]:
    """The position's model_optim_rng.pt and its distributed-optimizer shard's file (`position`
    = (tensor, pipeline, shard) with shards; shard 0 without)."""
    base = loading.iteration_dir(directory, iteration) / position_dir(position, pipeline_size)
    shard = position[2] if len(position) == 3 else 0
    return base / MODEL_FILE, base / f"distrib_optim_shard_{shard:02d}.pt"


def save(directory: Path, state: RecoveryState, ddp_model, optimizer, scheduler,
         position: tuple[int, ...], pipeline_size: int, common: dict, replica_group,
         local_rank: int, written=lambda: None) -> None:
    """Write this rank's position; call on every rank of the writing replica only. `common`:
    `checkpoint_common.megatron_common`. `written()` is called once the rank's files are on
    disk, before the tracker names the checkpoint (the caller writes recover_state.json
    there)."""
    model_file, shard_file = _files(directory, state.iteration, position, pipeline_size)
    model_file.parent.mkdir(parents=True, exist_ok=True)
    if len(position) == 2 or position[2] == 0:  # a position's shards hold the same model
        _write(model_file, {
            **common, "iteration": state.iteration,
            "model": ddp_model.module.state_dict_for_save_checkpoint(),
            "optimizer": optimizer.state_dict(), "opt_param_scheduler": scheduler.state_dict(),
            "rng_state": [checkpoint_common.rng_state()],
            checkpoint_common.RECOVERY_KEY: state.to_dict()})
    if training_state.distributed_optimizers(optimizer):
        _write(shard_file, {"parameter_state": training_state.parameter_state(optimizer)})
    written()
    if replica_group is not None:
        dist.barrier(group=replica_group)  # every position of this replica is on disk
    if local_rank == 0:
        tracker = Path(directory) / TRACKER
        tracker.with_suffix(".tmp").write_text(f"{state.iteration}\n")
        os.replace(tracker.with_suffix(".tmp"), tracker)


def _write(path: Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(value, tmp)
    os.replace(tmp, path)


def _read(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"--load: {path} is missing; was the checkpoint written with the same "
                         "tensor and pipeline parallel sizes and distributed-optimizer shards?")
    try:
        # Plain values and tensors, and Megatron-LM's argument namespace (megatron-core
        # registers it with torch.load's safe types).
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, or not a torch file: the unpickler's own errors
        raise ValueError(f"--load: {path} cannot be read ({type(error).__name__}: {error}); "
                         "a torn or partial checkpoint? Load an earlier one (--ckpt-step)") from error


def write_summary(path: Path, state: RecoveryState) -> None:
    """recover_state.json in the checkpoint directory `path`: the recovery state, for people."""
    summary = {k: v for k, v in asdict(state).items() if k != "layout"}
    role_of = getattr(state.layout, "role_of", lambda replica: "major")  # adaptive: all majors
    summary["roles"] = {str(r): role_of(r) for r in state.live_replicas}
    (path / "recover_state.json").write_text(json.dumps(summary, indent=2) + "\n")


def load(plan, ddp_model, optimizer, scheduler, position: tuple[int, ...], pipeline_size: int,
         cfg) -> tuple[int, dict | None]:
    """Load this position of the checkpoint `plan` (loading.LoadPlan) names into the model and,
    as the plan says, the optimizer with the scheduler and the generators. Returns the
    checkpoint's iteration and its recovery state (None in a file Megatron-LM wrote)."""
    model_file, shard_file = _files(plan.directory, plan.iteration, position, pipeline_size)
    saved = _read(model_file)
    try:
        ddp_model.module.load_state_dict(saved["model"])
    except RuntimeError as error:  # load_state_dict's missing keys and size mismatches
        raise ValueError(loading.model_mismatch(model_file, error)) from error
    if plan.optimizer:
        optimizer.load_state_dict(saved["optimizer"])
        if training_state.distributed_optimizers(optimizer):
            if not shard_file.is_file():
                raise ValueError(f"--load: {shard_file} is missing: this run's distributed "
                                 "optimizer needs its shard's state (Megatron-LM's own "
                                 "distrib_optim.pt is not read here); load with "
                                 "--no-load-optim, or resume from a torch_dist checkpoint")
            training_state.load_parameter_state(optimizer,
                                                _read(shard_file)["parameter_state"])
        scheduler.load_state_dict(saved.get("lr_scheduler") or saved["opt_param_scheduler"])
    else:
        # fp16/bf16: the optimizer's fp32 main parameters still hold the initial values, and
        # its first step would copy them over the loaded model (Megatron-LM reloads them too).
        optimizer.reload_model_params()
    if plan.rng:
        checkpoint_common.restore_rng_state(saved["rng_state"][0])
    if plan.resumes and "args" in saved:
        checkpoint_common.check_data_position(saved["args"], saved["iteration"], cfg)
    return saved["iteration"], saved.get(checkpoint_common.RECOVERY_KEY)
