"""Checkpoints that can be written after failures and resumed on fewer replicas.

Layout (Megatron's torch format): SAVE/iter_NNNNNNN/mp_rank_TT_PPP.pt holds one intra-replica
position's model, optimizer and scheduler state plus the recovery state (B, W_init, G_init,
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

TRACKER = "latest_checkpointed_iteration.txt"


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


def _iteration_dir(directory: Path, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def position_name(position: tuple[int, ...]) -> str:
    """position: (tensor rank, pipeline rank) or, with distributed-optimizer shards, (tensor
    rank, pipeline rank, shard)."""
    name = f"mp_rank_{position[0]:02d}_{position[1]:03d}"
    if len(position) == 3:
        name += f"_shard_{position[2]:02d}"
    return name


def _position_file(directory: Path, iteration: int, position: tuple[int, ...]) -> Path:
    return _iteration_dir(directory, iteration) / f"{position_name(position)}.pt"


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt for opt in chained if isinstance(opt, DistributedOptimizer)]


def parameter_state(optimizer) -> list[dict]:
    """Per distributed optimizer, this shard's main parameters and Adam moments, by parameter."""
    return [{opt._param_name(param): {k: v.detach().clone() for k, v in
                                      opt._get_main_param_and_optimizer_states(param).items()}
             for param in opt.model_param_group_index_map}
            for opt in _distributed_optimizers(optimizer)]


def _load_parameter_state(optimizer, saved: list[dict]) -> None:
    optimizers = _distributed_optimizers(optimizer)
    if len(saved) != len(optimizers):
        raise ValueError("--load: the checkpoint holds no distributed-optimizer state for this "
                         "run (written without --use-distributed-optimizer, or before such "
                         "checkpoints held it): resume with the optimizer set-up it was "
                         "written with")
    with torch.no_grad():  # the main parameters are leaves that require grad
        for opt, state in zip(optimizers, saved):
            # DistributedOptimizer.load_state_dict (without Apex/TE) gives every parameter's
            # state one shared `step` tensor, which torch's Adam then increments once per
            # parameter per step: the bias correction runs ahead. One tensor each.
            for param_state in opt.optimizer.state.values():
                param_state["step"] = param_state["step"].clone()
            for param in opt.model_param_group_index_map:
                opt._set_main_param_and_optimizer_states(param, state[opt._param_name(param)])


def training_state(ddp_model, optimizer, scheduler) -> dict:
    """This rank's model, optimizer (loss scaler and, with the distributed optimizer, this
    shard's main parameters and Adam moments) and scheduler state, as torch.save writes it."""
    return {"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(),
            "parameter_state": parameter_state(optimizer), "scheduler": scheduler.state_dict()}


def load_training_state(saved: dict, ddp_model, optimizer, scheduler) -> None:
    """Install what `training_state` returned (on another rank of the same position)."""
    ddp_model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    _load_parameter_state(optimizer, saved.get("parameter_state", []))
    scheduler.load_state_dict(saved["scheduler"])


def save(directory: Path, state: RecoveryState, ddp_model, optimizer, scheduler,
         position: tuple[int, ...], replica_group, local_rank: int) -> None:
    """Write this rank's position; call on every rank of the writing replica only."""
    path = _position_file(directory, state.iteration, position)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({**training_state(ddp_model, optimizer, scheduler), "recovery": state}, tmp)
    os.replace(tmp, path)
    if replica_group is not None:
        dist.barrier(group=replica_group)  # every position of this replica is on disk
    if local_rank == 0:
        summary = {k: v for k, v in asdict(state).items() if k != "layout"}
        role_of = getattr(state.layout, "role_of", lambda replica: "major")  # adaptive: all majors
        summary["roles"] = {str(r): role_of(r) for r in state.live_replicas}
        (path.parent / "recover_state.json").write_text(json.dumps(summary, indent=2) + "\n")
        tracker = Path(directory) / TRACKER
        tracker.with_suffix(".tmp").write_text(f"{state.iteration}\n")
        os.replace(tracker.with_suffix(".tmp"), tracker)


def latest_iteration(directory: Path) -> int | None:
    """The newest complete checkpoint's iteration; None when `directory` holds none (missing,
    empty, or no tracker yet: a job script's first launch with `--save d --load d`)."""
    tracker = Path(directory) / TRACKER
    if not tracker.is_file():
        return None
    return int(tracker.read_text().strip())


def load(directory: Path, ddp_model, optimizer, scheduler,
         position: tuple[int, ...]) -> RecoveryState:
    """Load this position of the newest checkpoint into the model, optimizer and scheduler.
    The caller checked that there is one (`latest_iteration`)."""
    path = _position_file(directory, latest_iteration(directory), position)
    if not path.is_file():
        raise ValueError(f"--load: {path} is missing; was the checkpoint written with the same "
                         "tensor and pipeline parallel sizes and distributed-optimizer shards?")
    # Our own files: they hold the policy layout, a plain dataclass, besides tensors.
    saved = torch.load(path, map_location="cpu", weights_only=False)
    load_training_state(saved, ddp_model, optimizer, scheduler)
    return saved["recovery"]
