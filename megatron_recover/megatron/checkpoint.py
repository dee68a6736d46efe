"""Checkpoints that can be written after failures and resumed on fewer replicas.

Layout (Megatron's torch format): SAVE/iter_NNNNNNN/mp_rank_TT_PPP.pt holds one intra-replica
position's model, optimizer and scheduler state plus the recovery state (B, W_init, G_init,
policy, mode, the policy layout, data position, reserve pointer); SAVE/iter_NNNNNNN/recover_state.json
repeats the recovery state for people; SAVE/latest_checkpointed_iteration.txt names the newest
complete one.

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


def _iteration_dir(directory: Path, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def _position_file(directory: Path, iteration: int, tp_rank: int, pp_rank: int) -> Path:
    return _iteration_dir(directory, iteration) / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}.pt"


def save(directory: Path, state: RecoveryState, ddp_model, optimizer, scheduler,
         position: tuple[int, int], replica_group, local_rank: int) -> None:
    """Write this rank's position; call on every rank of the writing replica only."""
    path = _position_file(directory, state.iteration, *position)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "recovery": state}, tmp)
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


def latest_iteration(directory: Path) -> int:
    tracker = Path(directory) / TRACKER
    if not tracker.is_file():
        raise ValueError(f"--load {directory}: no {TRACKER}; nothing to resume")
    return int(tracker.read_text().strip())


def load(directory: Path, ddp_model, optimizer, scheduler,
         position: tuple[int, int]) -> RecoveryState:
    """Load this position of the newest checkpoint into the model, optimizer and scheduler."""
    path = _position_file(directory, latest_iteration(directory), *position)
    if not path.is_file():
        raise ValueError(f"--load: {path} is missing; was the checkpoint written with the same "
                         "tensor and pipeline parallel sizes?")
    # Our own files: they hold the policy layout, a plain dataclass, besides tensors.
    saved = torch.load(path, map_location="cpu", weights_only=False)
    ddp_model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    return saved["recovery"]
