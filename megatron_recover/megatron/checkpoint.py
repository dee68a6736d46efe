"""--recover checkpoints: written after failures, resumed on fewer replicas.

Two formats, as Megatron-LM's --ckpt-format: torch_dist (the default; `dist_checkpoint.py`
writes and reads it, and it is the format stock runs use) and torch, this module's files:

Layout (--ckpt-format torch): SAVE/iter_NNNNNNN/mp_rank_TT_PPP.pt holds one intra-replica
position's complete training state (`state.capture`: model, optimizer, scheduler, random
number generators) plus the recovery state (B, W_init, G_init,
policy, mode, the policy layout, data position, reserve pointer); with distributed-optimizer
shards, each shard of the position writes mp_rank_TT_PPP_shard_SS.pt with its own part of the
optimizer state. SAVE/iter_NNNNNNN/recover_state.json repeats the recovery state for people;
SAVE/latest_checkpointed_iteration.txt names the newest complete one.

megatron-core's DistributedOptimizer.state_dict() leaves out the parameter state (fp32 main
parameters and Adam moments: Megatron-LM saves them in a separate file); the files here hold
it too, per shard, so a resumed run continues the uninterrupted one.

Writing uses only groups without dead ranks: the lowest live replica (by the policy, which every
rank agrees on) writes one file per position, its ranks meet in a barrier on their own
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

from megatron_recover.megatron import loading
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


def position_name(position: tuple[int, ...]) -> str:
    """position: (tensor rank, pipeline rank) or, with distributed-optimizer shards, (tensor
    rank, pipeline rank, shard)."""
    name = f"mp_rank_{position[0]:02d}_{position[1]:03d}"
    if len(position) == 3:
        name += f"_shard_{position[2]:02d}"
    return name


def _position_file(directory: Path, iteration: int, position: tuple[int, ...]) -> Path:
    return loading.iteration_dir(directory, iteration) / f"{position_name(position)}.pt"


def save(directory: Path, state: RecoveryState, ddp_model, optimizer, scheduler,
         position: tuple[int, ...], replica_group, local_rank: int, written=lambda: None) -> None:
    """Write this rank's position; call on every rank of the writing replica only. `written()`
    is called once the position's file is on disk, before the tracker names the checkpoint."""
    path = _position_file(directory, state.iteration, position)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({**training_state.capture(ddp_model, optimizer, scheduler), "recovery": state}, tmp)
    os.replace(tmp, path)
    written()
    if replica_group is not None:
        dist.barrier(group=replica_group)  # every position of this replica is on disk
    if local_rank == 0:
        write_summary(path.parent, state)
        tracker = Path(directory) / TRACKER
        tracker.with_suffix(".tmp").write_text(f"{state.iteration}\n")
        os.replace(tracker.with_suffix(".tmp"), tracker)


def write_summary(path: Path, state: RecoveryState) -> None:
    """recover_state.json in the checkpoint directory `path`: the recovery state, for people."""
    summary = {k: v for k, v in asdict(state).items() if k != "layout"}
    role_of = getattr(state.layout, "role_of", lambda replica: "major")  # adaptive: all majors
    summary["roles"] = {str(r): role_of(r) for r in state.live_replicas}
    (path / "recover_state.json").write_text(json.dumps(summary, indent=2) + "\n")


def load(plan, ddp_model, optimizer, scheduler, position: tuple[int, ...]) -> RecoveryState:
    """Load this position of the checkpoint `plan` (loading.LoadPlan) names into the model and,
    as the plan says, the optimizer with the scheduler and the generators."""
    path = _position_file(plan.directory, plan.iteration, position)
    if not path.is_file():
        raise ValueError(f"--load: {path} is missing; was the checkpoint written with the same "
                         "tensor and pipeline parallel sizes and distributed-optimizer shards?")
    try:
        # Our own files: they hold the policy layout, a plain dataclass, besides tensors.
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # truncated, or not a torch file: the unpickler's own errors
        raise ValueError(f"--load: {path} cannot be read ({type(error).__name__}: {error}); "
                         "a torn or partial checkpoint? Load an earlier one (--ckpt-step)") from error
    if "recovery" not in saved:
        raise ValueError(f"--load: {path} is not a --recover checkpoint (no recovery state)")
    try:
        training_state.restore(saved, ddp_model, optimizer, scheduler, optim=plan.optimizer,
                               rng=plan.rng)
    except RuntimeError as error:  # load_state_dict's missing keys and size mismatches
        raise ValueError(loading.model_mismatch(path, error)) from error
    return saved["recovery"]
