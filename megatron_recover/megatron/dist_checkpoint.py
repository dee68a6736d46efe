"""Checkpoint-restart as Megatron users run it today: megatron-core distributed checkpoints.

Stock runs (no --recover) with `--save DIR --save-interval N` and `--load DIR` save and resume
the way Megatron-LM's `--ckpt-format torch_dist` does, through `megatron.core.dist_checkpointing`:

  DIR/iter_NNNNNNN/                    one torch_dist checkpoint, written by every rank
  DIR/latest_checkpointed_iteration.txt  the newest complete one (rank 0, after every rank wrote)

A checkpoint holds what Megatron-LM's `generate_state_dict` puts in one: the model's
`sharded_state_dict()`, the optimizer's sharded state over it, the scheduler state, the iteration
and the RNG states (one object per tensor x pipeline position; data-parallel ranks draw alike,
so data-parallel rank 0 writes it). Replicated tensors are spread over the data-parallel ranks
for writing (Megatron-LM's default fully parallel save). The data needs no state: a stock
iteration's microbatch ids depend only on the iteration number.

As in Megatron-LM, `--load` of a directory without a tracker file starts from scratch (a job
script passes the same `--save`/`--load` on every launch); Megatron-LM's load flags
(`--finetune`, `--no-load-optim`, ...) are resolved in `loading.py`. Rank 0 prints one line per save and
load with its wall-clock span, which scripts/run_restart_baseline.py reads.
"""

import time
from pathlib import Path

import torch.distributed as dist

from megatron_recover.megatron import loading
from megatron_recover.megatron import state as training_state

TRACKER = loading.TRACKER
FORMAT_FILE = "metadata.json"  # what dist_checkpointing writes last into a complete checkpoint
# As Megatron-LM passes them: the optimizer's keys follow the model's (no chained prefix).
_METADATA = {"chained_optim_avoid_prefix": True, "singleton_local_shards": False}


def check_start(cfg) -> None:
    """Start-up checks of a stock run's --save/--load (ValueError says what to change)."""
    if not (cfg.checkpoint.save or cfg.checkpoint.load):
        return
    if cfg.parallel.use_distributed_optimizer:
        # Without Apex or Transformer Engine, megatron-core 0.16.1's DistributedOptimizer cannot
        # build the sharded state a load needs before its first step (its state_dict asserts).
        raise ValueError("--save/--load of stock runs do not support --use-distributed-optimizer "
                         "yet: drop one of them")
    for directory in (cfg.checkpoint.load, cfg.checkpoint.pretrained_checkpoint):
        if directory:
            check_loadable(directory)


def check_loadable(directory) -> None:
    """A tracker in `directory`, if present, must name a torch_dist checkpoint."""
    iteration = loading.tracked_iteration(directory)
    if iteration is None:
        return
    path = loading.iteration_dir(directory, iteration)
    if not (path / FORMAT_FILE).is_file():
        raise ValueError(f"--load {directory}: {path} is not a megatron-core distributed "
                         f"(torch_dist) checkpoint (no {FORMAT_FILE}); stock runs resume from "
                         "checkpoints written by stock runs, --recover runs from --recover ones")


# Megatron-LM's names for the generators of `state.capture_rng` in its checkpoints' rng_state.
_MEGATRON_RNG_NAMES = {"random": "random_rng_state", "numpy": "np_rng_state",
                       "torch": "torch_rng_state", "cuda": "cuda_rng_state",
                       "tracker": "rng_tracker_states"}


def _rng_state():
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {_MEGATRON_RNG_NAMES[k]: v for k, v in training_state.capture_rng().items()}
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size())
    offset = (parallel_state.get_pipeline_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_rank())
    return ShardedObject("rng_state", [state], shape, offset,
                         replica_id=parallel_state.get_data_parallel_rank())


def _set_rng_state(saved) -> None:
    training_state.restore_rng({k: saved[0][name] for k, name in _MEGATRON_RNG_NAMES.items()})


def _state_dict(ddp_model, optimizer, scheduler, iteration: int, is_loading: bool,
                optim: bool = True, rng: bool = True) -> dict:
    """What a checkpoint holds; for a load, the parts to read (`optim`: the optimizer and the
    scheduler; `rng`: the generators)."""
    model = ddp_model.module.sharded_state_dict()
    state = {"model": model, "iteration": iteration}
    if optim:
        state["optimizer"] = optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                          metadata=_METADATA)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if rng:
        state["rng_state"] = _rng_state()
    return state


def _report(message: str, start: float, end: float) -> None:
    if dist.get_rank() == 0:
        print(f"  {message} [ {end - start:.3f} s, wall {start:.3f} -> {end:.3f} ]", flush=True)


def save(directory, iteration: int, ddp_model, optimizer, scheduler) -> None:
    """Write iteration `iteration`'s checkpoint; every rank calls, all return once it is complete
    and the tracker names it."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    start = time.time()
    path = loading.iteration_dir(directory, iteration)
    path.mkdir(parents=True, exist_ok=True)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                parallel_state.get_data_parallel_group())
    dist_checkpointing.save(_state_dict(ddp_model, optimizer, scheduler, iteration, False),
                            str(path), sharded_strategy=strategy)
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        tracker = Path(directory) / TRACKER
        tracker.with_suffix(".tmp").write_text(f"{iteration}\n")
        tracker.with_suffix(".tmp").replace(tracker)
    _report(f"successfully saved checkpoint from iteration {iteration:7d} to {directory}",
            start, time.time())


def nothing_to_load(directory, start: float) -> None:
    """Say that `directory` holds no checkpoint yet (the run starts from scratch)."""
    _report(f"no checkpoint in {directory}: training starts from iteration 1", start,
            time.time())


def load(plan, ddp_model, optimizer, scheduler) -> int:
    """Load what `plan` (loading.LoadPlan) names into the model and, as it says, the
    optimizer, scheduler and RNGs. Returns the iteration the run continues after: the
    checkpoint's, or 0 for a fine-tune."""
    from megatron.core import dist_checkpointing

    start = time.time()
    path = plan.path
    if not (path / FORMAT_FILE).is_file():
        raise ValueError(f"--load: {path} is not a complete megatron-core distributed "
                         f"(torch_dist) checkpoint (no {FORMAT_FILE})")
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint import CheckpointException  # torch's, gathered from ranks

    template = _state_dict(ddp_model, optimizer, scheduler, plan.iteration, True,
                           optim=plan.optimizer, rng=plan.rng)
    try:
        state = dist_checkpointing.load(template, str(path))
        ddp_model.module.load_state_dict(state["model"])
    except (CheckpointingException, CheckpointException, RuntimeError) as error:  # shapes, keys
        raise ValueError(loading.model_mismatch(path, error)) from error
    if plan.optimizer:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()  # fp16/bf16 main parameters from the loaded model
    if plan.rng:
        _set_rng_state(state["rng_state"])
    if state["iteration"] != plan.iteration:
        raise ValueError(f"--load: {path} holds iteration {state['iteration']}, not "
                         f"{plan.iteration}")
    dist.barrier()  # every rank resumed
    _report(f"successfully loaded checkpoint from {plan.directory} at iteration "
            f"{plan.iteration:7d}" + ("" if plan.resumes else " (fine-tuning from iteration 1)"),
            start, time.time())
    return plan.iteration if plan.resumes else 0
