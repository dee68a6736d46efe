"""The complete training state of one rank, defined once: what a node snapshot (`snapshots.py`)
and a standby's join (`standby.py`, `run.py`) carry, and the parts a checkpoint stores under
Megatron-LM's keys (`torch_format.py`, `torch_dist.py`).

`capture()` is this rank's model, optimizer (the loss scaler and, with the distributed optimizer,
this shard's main parameters and Adam moments, which its state_dict leaves out), learning-rate
scheduler and every random number generator a rank draws from (Python's, NumPy's, torch's CPU
and device generators and megatron-core's model-parallel RNG tracker). `restore()` installs it on
a rank of the same TP x PP (x shard) position (`recovery/membership/transfer.py` sends it over a
ulfm group); `digests` are what survivors and a joiner must hold bitwise alike.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

RNG_KEYS = ("random", "numpy", "torch", "cuda", "tracker")


def capture_rng() -> dict:
    """Every generator this rank draws from (the device's: a GPU's, or the CPU emulation's)."""
    from megatron.core import tensor_parallel

    return {"random": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def restore_rng(states: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    torch.cuda.set_rng_state(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])


def distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt for opt in chained if isinstance(opt, DistributedOptimizer)]


def _param_names(opt) -> dict:
    """Parameter -> its name in the distributed optimizer's model chunks, prefixed by the
    chunk's index when there are several (megatron-core's own `_param_name` refuses chunks
    whose names repeat, and every virtual stage's layers are numbered from 0)."""
    names = getattr(opt, "_recover_param_names", None)
    if names is None:
        chunks = opt.model_chunks
        names = {param: (name if len(chunks) == 1 else f"{index}.{name}")
                 for index, chunk in enumerate(chunks) for name, param in chunk.named_parameters()}
        opt._recover_param_names = names
    return names


def parameter_state(optimizer) -> list[dict]:
    """Per distributed optimizer, this shard's main parameters and Adam moments, by parameter."""
    return [{_param_names(opt)[param]: {k: v.detach().clone() for k, v in
                                        opt._get_main_param_and_optimizer_states(param).items()}
             for param in opt.model_param_group_index_map}
            for opt in distributed_optimizers(optimizer)]


def initialize_optimizer_state(optimizer) -> None:
    """Give each distributed optimizer's Adam the state its first step would create (zero
    moments, step 0) if it has none yet. megatron-core's DistributedOptimizer (0.16.1 and 0.19.0
    alike) builds a
    load's template, and a save, from its own state_dict, which with torch's Adam (no Apex or
    Transformer Engine) asserts that every parameter holds a step; before the first successful
    step (a load at start-up, or a save after fp16 skipped every step) none does."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    if HAVE_APEX_OR_TE:  # their Adam keeps no per-parameter step, and creates its state itself
        return
    for opt in distributed_optimizers(optimizer):
        if opt.optimizer.state:
            continue
        opt.init_state_fn(opt.optimizer, opt.config)
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                opt.optimizer.state[param]["step"] = torch.tensor(0.0)


def restore_steps(optimizer) -> None:
    """Give each parameter of a distributed optimizer the step count its group loaded, one
    tensor each; call after DistributedOptimizer.load_state_dict. Without Apex/TE that call
    gives every parameter one shared `step` tensor, which torch's Adam then increments once per
    parameter per step (the bias correction would run ahead), and a torch_dist load then
    copies the load template's step over it (the template's, 0 before the first step). With
    Apex or Transformer Engine their Adam keeps the step in its groups: nothing to do."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    if HAVE_APEX_OR_TE:
        return
    for opt in distributed_optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                opt.optimizer.state[param]["step"] = torch.tensor(float(group["step"]))


def load_parameter_state(optimizer, saved: list[dict]) -> None:
    """Install what `parameter_state` returned (on a rank of the same position and shard)."""
    optimizers = distributed_optimizers(optimizer)
    if len(saved) != len(optimizers):
        raise ValueError("--load: the checkpoint holds no distributed-optimizer state for this "
                         "run (written without --use-distributed-optimizer, or before such "
                         "checkpoints held it): resume with the optimizer set-up it was "
                         "written with")
    restore_steps(optimizer)
    with torch.no_grad():  # the main parameters are leaves that require grad
        for opt, state in zip(optimizers, saved):
            for param in opt.model_param_group_index_map:
                opt._set_main_param_and_optimizer_states(param, state[_param_names(opt)[param]])


def model_keys(chunks) -> list[str]:
    """Megatron-LM's keys of a rank's model chunks in its state: "model", or with virtual
    pipeline stages "model0", "model1", ..."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def capture(chunks, optimizer, scheduler) -> dict:
    """This rank's complete training state (`chunks`: its DDP model chunks), as torch.save
    writes it (tensors are the live ones: clone them to keep a copy past the next step)."""
    return {**{key: chunk.module.state_dict() for key, chunk in zip(model_keys(chunks), chunks)},
            "optimizer": optimizer.state_dict(),
            "parameter_state": parameter_state(optimizer), "scheduler": scheduler.state_dict(),
            "rng": capture_rng()}


def restore(saved: dict, chunks, optimizer, scheduler) -> None:
    """Install what `capture` returned (on a rank of the same position)."""
    for key, chunk in zip(model_keys(chunks), chunks):
        chunk.module.load_state_dict(saved[key])
    optimizer.load_state_dict(saved["optimizer"])
    load_parameter_state(optimizer, saved.get("parameter_state", []))
    scheduler.load_state_dict(saved["scheduler"])
    restore_rng(saved["rng"])


def parameter_digest(model) -> str:
    """sha256 over this rank's parameters: survivors of one position must agree bitwise."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def optimizer_digest(optimizer) -> str:
    """sha256 over megatron's optimizer state_dict (Adam moments, main parameters, scaler) and,
    with the distributed optimizer, this shard's main parameters and Adam moments (its
    state_dict holds neither)."""
    digest = hashlib.sha256()

    def walk(value):
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                digest.update(str(key).encode())
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        else:
            digest.update(repr(value).encode())

    walk(optimizer.state_dict())
    walk(parameter_state(optimizer))
    return digest.hexdigest()


def digests(model, optimizer) -> dict:
    """What a joiner must hold exactly as its donor: parameters (of the unwrapped model),
    optimizer state, loss scale."""
    return {"params": parameter_digest(model), "optimizer": optimizer_digest(optimizer),
            "loss_scale": float(optimizer.get_loss_scale())}
