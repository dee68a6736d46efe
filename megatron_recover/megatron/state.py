"""The complete training state of one rank, defined once: what a checkpoint (`checkpoint.py`),
a node snapshot (`snapshot.py`) and a standby's join (`standby.py`, `run.py`) carry.

`capture()` is this rank's model, optimizer (the loss scaler and, with the distributed optimizer,
this shard's main parameters and Adam moments, which its state_dict leaves out), learning-rate
scheduler and every random number generator a rank draws from (Python's, NumPy's, torch's CPU
and device generators and megatron-core's model-parallel RNG tracker). `restore()` installs it on
a rank of the same TP x PP (x shard) position. `to_bytes`/`from_bytes` serialize it for a
broadcast; `digests` are what survivors and a joiner must hold bitwise alike.
"""

from __future__ import annotations

import hashlib
import io
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


def capture(ddp_model, optimizer, scheduler) -> dict:
    """This rank's complete training state, as torch.save writes it (tensors are the live ones:
    clone them to keep a copy past the next step)."""
    return {"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(),
            "parameter_state": parameter_state(optimizer), "scheduler": scheduler.state_dict(),
            "rng": capture_rng()}


def restore(saved: dict, ddp_model, optimizer, scheduler) -> None:
    """Install what `capture` returned (on a rank of the same position)."""
    ddp_model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    _load_parameter_state(optimizer, saved.get("parameter_state", []))
    scheduler.load_state_dict(saved["scheduler"])
    if "rng" in saved:  # --recover checkpoints written before they held the generators do not
        restore_rng(saved["rng"])


def to_bytes(state: dict) -> torch.Tensor:
    """`state` (tensors and plain objects) as a uint8 tensor for a broadcast."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def from_bytes(blob: torch.Tensor) -> dict:
    # Our own bytes, from a rank of the same job: they hold the policy layout besides tensors.
    return torch.load(io.BytesIO(blob.numpy().tobytes()), map_location="cpu", weights_only=False)


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
