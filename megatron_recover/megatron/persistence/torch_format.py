"""--recover's `--ckpt-format torch`: Megatron-LM's per-rank torch files, written after failures
and resumed on fewer replicas; and the protocol state every --recover checkpoint carries.

Two formats, as Megatron-LM's --ckpt-format: torch_dist (the default; `torch_dist.py`
writes and reads it, and it is the format stock runs use) and torch, this module's files, in
Megatron-LM's layout (megatron/training/checkpointing.py, core_v0.16.1 and core_v0.19.0 alike):

  SAVE/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt   one (tensor, pipeline) position:
      Megatron-LM's keys (`checkpoint_common.megatron_common`: args, checkpoint_version, the
      FLOPs counter; iteration, model, optimizer, opt_param_scheduler, rng_state) and the
      protocol state (`recover_state`: `ProtocolState.state_dict()`, as snapshots and joins
      carry it: B, W_init, G_init, policy, mode, the policy layout, reserve pointer, straggler
      history, dead replicas, committed reserve ids)
  SAVE/iter_NNNNNNN/mp_rank_TT[_PPP]/distrib_optim.pt   with the distributed optimizer, its
      main parameters and Adam moments (its state_dict leaves them out), gathered from the
      shards by megatron-core's own save_parameter_state, as Megatron-LM writes it: it loads
      on any number of shards
  SAVE/iter_NNNNNNN/recover_state.json   the protocol state, for people
  SAVE/latest_checkpointed_iteration.txt   the newest complete one

Writing uses only groups without dead ranks: the lowest live replica (by the policy, which every
rank agrees on) writes its positions' files, its ranks meet in a barrier on their own
intra-replica group, and its local rank 0 then moves the tracker. No world-wide gather or
barrier, so a dead replica 0 leaves nothing unwritten. Replicas hold identical states, so any
live replica's files are the checkpoint.
"""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_recover.megatron.persistence import common as checkpoint_common, loading
from megatron_recover.megatron.persistence import training_state
from megatron_recover.recovery.protocol_state import ProtocolState

TRACKER = loading.TRACKER


MODEL_FILE = "model_optim_rng.pt"


def position_dir(position: tuple[int, ...], pipeline_size: int) -> str:
    """Megatron-LM's directory of a (tensor, pipeline) position: mp_rank_TT, or mp_rank_TT_PPP
    with pipeline parallelism."""
    name = f"mp_rank_{position[0]:02d}"
    return name + f"_{position[1]:03d}" if pipeline_size > 1 else name


OPTIMIZER_FILE = "distrib_optim.pt"


def _files(directory, iteration: int, position: tuple[int, ...],
           pipeline_size: int) -> tuple[Path, Path]:
    """The position's model_optim_rng.pt and distrib_optim.pt (`position`: (tensor, pipeline),
    and the shard with distributed-optimizer shards, which share both files)."""
    base = loading.iteration_dir(directory, iteration) / position_dir(position, pipeline_size)
    return base / MODEL_FILE, base / OPTIMIZER_FILE


def save(directory: Path, state: ProtocolState, chunks, optimizer, scheduler,
         position: tuple[int, ...], pipeline_size: int, common: dict, replica_group,
         local_rank: int, written=lambda: None) -> None:
    """Write this rank's position; call on every rank of the writing replica only. `common`:
    `checkpoint_common.megatron_common`. `written()` is called once the rank's files are on
    disk, before the tracker names the checkpoint (the caller writes recover_state.json
    there)."""
    model_file, optimizer_file = _files(directory, state.iteration, position, pipeline_size)
    model_file.parent.mkdir(parents=True, exist_ok=True)
    first_shard = len(position) == 2 or position[2] == 0
    if training_state.distributed_optimizers(optimizer):
        # Collective over the position's shards: the first writes what they gathered.
        training_state.initialize_optimizer_state(optimizer)
        optimizer.save_parameter_state(str(optimizer_file))
    if first_shard:  # a position's shards hold the same model
        _write(model_file, {
            **common, "iteration": state.iteration,
            **{key: chunk.module.state_dict_for_save_checkpoint()
               for key, chunk in zip(training_state.model_keys(chunks), chunks)},
            "optimizer": optimizer.state_dict(), "opt_param_scheduler": scheduler.state_dict(),
            "rng_state": [checkpoint_common.rng_state()],
            checkpoint_common.RECOVERY_KEY: state.state_dict()})
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
                         "tensor and pipeline parallel sizes?")
    try:
        # Plain values and tensors, and Megatron-LM's argument namespace (megatron-core
        # registers it with torch.load's safe types).
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, or not a torch file: the unpickler's own errors
        raise ValueError(f"--load: {path} cannot be read ({type(error).__name__}: {error}); "
                         "a torn or partial checkpoint? Load an earlier one (--ckpt-step)") from error


def _load_parameter_state(optimizer, path: Path) -> None:
    """The distributed optimizer's main parameters and Adam moments from `path` (a
    distrib_optim.pt, any number of shards wrote it): the first shard of the position reads and
    checks it, then megatron-core scatters it over this run's shards. Collective over them; a
    file that does not fit stops every shard with the first one's reason (none is left waiting
    in the scatter)."""
    optimizers = training_state.distributed_optimizers(optimizer)
    group = optimizers[0].data_parallel_group_gloo
    saved, verdict = None, [None]
    if dist.get_rank(group) == 0:
        try:
            saved = _parameter_state(optimizers, path)
        except ValueError as error:
            verdict = [str(error)]
    dist.broadcast_object_list(verdict, src=dist.get_global_rank(group, 0), group=group)
    if verdict[0] is not None:
        raise ValueError(verdict[0])
    # megatron-core (0.16.1 and 0.19.0 alike) copies the file's tensors over every entry of a
    # parameter's optimizer state, which with torch's Adam (no Apex or Transformer Engine) also
    # holds `step`, a key the file does not have: the steps leave for the copy and come back from
    # the groups.
    for distributed in optimizers:
        for param_state in distributed.optimizer.state.values():
            param_state.pop("step", None)
    with torch.no_grad():  # the main parameters are leaves that require grad
        for distributed, state in zip(optimizers, saved or [None] * len(optimizers)):
            distributed.load_parameter_state_from_dp_zero(state)
    training_state.restore_steps(optimizer)


def _parameter_state(optimizers: list, path: Path) -> list[dict]:
    """distrib_optim.pt's state per distributed optimizer (megatron-core writes one optimizer's
    as a dict, a chain's as a list), checked against this run's gradient buffers."""
    if not path.is_file():
        raise ValueError(f"--load: {path} is missing: this run's distributed optimizer needs "
                         "its main parameters and moments; was the checkpoint written without "
                         "--use-distributed-optimizer? Load with --no-load-optim, or with the "
                         "optimizer it was written with")
    saved = _read(path)
    saved = saved if isinstance(saved, list) else [saved]
    written = [[(dtype, state["numel_unpadded"]) for index in sorted(k for k in one
                                                                      if isinstance(k, int))
                for dtype, state in one[index].items()] for one in saved]
    wanted = [[(dtype, opt.buffers[index].numel_unpadded)
               for index, by_dtype in enumerate(opt.gbuf_ranges) for dtype in by_dtype]
              for opt in optimizers]
    if written != wanted:
        raise ValueError(f"--load: {path} holds distributed-optimizer state for gradient "
                         f"buffers {written} (dtype, elements), this run's are {wanted}: another "
                         "model or optimizer set-up; load with --no-load-optim, or with the "
                         "set-up it was written with")
    return saved


def write_summary(path: Path, state: ProtocolState) -> None:
    """recover_state.json in the checkpoint directory `path`: the protocol state, for people
    (`ProtocolState.summary`)."""
    (path / "recover_state.json").write_text(json.dumps(state.summary(), indent=2) + "\n")


def load(plan, chunks, optimizer, scheduler, position: tuple[int, ...], pipeline_size: int,
         cfg) -> tuple[int, dict | None]:
    """Load this position of the checkpoint `plan` (loading.LoadPlan) names into the model and,
    as the plan says, the optimizer with the scheduler and the generators. Returns the
    checkpoint's iteration and its protocol state's `state_dict()` (None in a file Megatron-LM
    wrote)."""
    model_file, optimizer_file = _files(plan.directory, plan.iteration, position,
                                        pipeline_size)
    saved = _read(model_file)
    try:
        for key, chunk in zip(training_state.model_keys(chunks), chunks):
            chunk.module.load_state_dict(saved[key])
    except (RuntimeError, KeyError) as error:  # missing keys and chunks, size mismatches
        raise ValueError(loading.model_mismatch(model_file, error)) from error
    if plan.optimizer:
        loading.load_optimizer_state(optimizer, saved["optimizer"], model_file)
        if training_state.distributed_optimizers(optimizer):
            _load_parameter_state(optimizer, optimizer_file)
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
