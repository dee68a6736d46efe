"""The complete training state of one rank, defined once: what a node snapshot (`snapshot.py`)
and a standby's join (`standby.py`, `run.py`) carry, and the parts a checkpoint stores under
Megatron-LM's keys (`checkpoint.py`, `dist_checkpoint.py`).

`capture()` is this rank's model, optimizer (the loss scaler and, with the distributed optimizer,
this shard's main parameters and Adam moments, which its state_dict leaves out), learning-rate
scheduler and every random number generator a rank draws from (Python's, NumPy's, torch's CPU
and device generators and megatron-core's model-parallel RNG tracker). `restore()` installs it on
a rank of the same TP x PP (x shard) position. `broadcast_state` sends it over a ulfm group
tensor by tensor (a standby's join, a snapshot's hand-over); `to_bytes`/`from_bytes` serialize
small objects; `digests` are what survivors and a joiner must hold bitwise alike.
"""

from __future__ import annotations

import hashlib
import io
import math
import random
from dataclasses import dataclass

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
    moments, step 0) if it has none yet. megatron-core 0.16.1's DistributedOptimizer builds a
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


def to_bytes(state) -> torch.Tensor:
    """`state` (tensors and plain objects) as a uint8 tensor for a broadcast (no copy of the
    serialized bytes: the tensor shares the buffer torch.save wrote)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)


def from_bytes(blob: torch.Tensor):
    # Our own bytes, from a rank of the same job: they hold the policy layout besides tensors.
    return torch.load(io.BytesIO(blob.numpy().tobytes()), map_location="cpu", weights_only=False)


# A state travels as its structure (every tensor replaced by a `_Slot`, small, pickled) and then
# its tensors' bytes, in packs of at most PACK_BYTES: small tensors share a pack, a larger one
# goes alone, straight from its own memory. No rank ever holds the whole state serialized.
PACK_BYTES = 64 << 20
_ALIGN = 16  # offsets of tensors in a pack, so that each is a view of the pack's bytes


@dataclass(frozen=True)
class _Slot:
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _rebuilt(value, parts):
    """A container of `value`'s type holding `parts`; a dict subclass keeps its attributes (a
    module state_dict's `_metadata`)."""
    if isinstance(value, dict):
        rebuilt = type(value)(parts)
        attributes = getattr(value, "__dict__", None)  # a plain dict has none
        if attributes:
            rebuilt.__dict__.update(attributes)
        return rebuilt
    return type(value)(parts)


def _is_sequence(value) -> bool:
    return isinstance(value, (list, tuple)) and not hasattr(value, "_fields")  # not namedtuples


def split_tensors(value, tensors: list):
    """`value` (dicts, lists and tuples of tensors and plain objects) with each tensor replaced
    by a slot naming its index in `tensors`, where it is appended; `fill_tensors` puts tensors
    back. Containers keep their types, and a dict subclass its attributes."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1, value.dtype, tuple(value.shape))
    if isinstance(value, dict):
        return _rebuilt(value, ((k, split_tensors(v, tensors)) for k, v in value.items()))
    if _is_sequence(value):
        return _rebuilt(value, (split_tensors(v, tensors) for v in value))
    return value


def fill_tensors(value, tensors):
    """`value` (a structure from `split_tensors`) with each slot replaced by `tensors[index]`
    (a list, or a dict by index)."""
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, dict):
        return _rebuilt(value, ((k, fill_tensors(v, tensors)) for k, v in value.items()))
    if _is_sequence(value):
        return _rebuilt(value, (fill_tensors(v, tensors) for v in value))
    return value


def _slots(value, found: list) -> list:
    if isinstance(value, _Slot):
        found.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _slots(v, found)
    elif _is_sequence(value):
        for v in value:
            _slots(v, found)
    return found


def _packs(slots: list[_Slot]) -> list[list[tuple[_Slot, int]]]:
    """The slots in index order grouped into packs: [(slot, offset in the pack)]."""
    packs, current, used = [], [], 0
    for slot in sorted(slots, key=lambda s: s.index):
        if current and used + slot.nbytes > PACK_BYTES:
            packs.append(current)
            current, used = [], 0
        current.append((slot, used))
        used += -(-slot.nbytes // _ALIGN) * _ALIGN
    if current:
        packs.append(current)
    return packs


def _pack_bytes(pack) -> int:
    slot, offset = pack[-1]
    return offset + slot.nbytes


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def tensor_bytes(state) -> int:
    """The bytes of every tensor in `state`, the part `broadcast_state` sends in packs."""
    tensors: list[torch.Tensor] = []
    split_tensors(state, tensors)
    return sum(t.numel() * t.element_size() for t in tensors)


def broadcast_state(group, donor: int, state, keep: bool = True):
    """Broadcast `state` (given on the donor, world rank `donor`; ignored elsewhere) over the
    ulfm `group`: its structure, then its tensors in packs. Every member calls it. Returns
    (state, ok): on the donor its own `state`; on the others the donor's, as host tensors
    (`keep`), or None (`keep` False: a member that only takes part, receiving into one scratch
    buffer). `ok` False: an operation failed (the group was repaired); what was received is
    not to be trusted, and the members agree on a retry by consensus.

    Memory: the donor copies at most one pack of small tensors at a time; a receiver holds
    the state's tensors and at most one pack besides, never a serialized copy of them.
    """
    sending = group.members[group.rank] == donor
    tensors: list[torch.Tensor] = []
    skeleton = split_tensors(state, tensors) if sending else None
    head = to_bytes(skeleton) if sending else None
    size = torch.tensor([head.numel() if sending else 0], dtype=torch.int64)
    if group.broadcast(size, donor).wait().has_failure:
        return None, False
    if not sending:
        head = torch.empty(int(size[0]), dtype=torch.uint8)
    if group.broadcast(head, donor).wait().has_failure:
        return None, False
    if not sending:
        skeleton = from_bytes(head)
    packs = _packs(_slots(skeleton, []))
    received: dict[int, torch.Tensor] = {}
    scratch = None
    for pack in packs:
        nbytes = _pack_bytes(pack)
        if sending and len(pack) == 1:
            buffer = _as_bytes(tensors[pack[0][0].index])
        elif sending:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            for slot, offset in pack:
                buffer[offset:offset + slot.nbytes].copy_(_as_bytes(tensors[slot.index]))
        elif keep:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        else:
            if scratch is None or scratch.numel() < nbytes:
                scratch = torch.empty(nbytes, dtype=torch.uint8)
            buffer = scratch[:nbytes]
        if group.broadcast(buffer, donor).wait().has_failure:
            return None, False
        if keep and not sending:
            for slot, offset in pack:
                tensor = buffer[offset:offset + slot.nbytes].view(slot.dtype).view(slot.shape)
                # A tensor sharing its pack is copied out: some readers of a state take a
                # tensor's storage from its start (torch.set_rng_state crashed on such a view).
                received[slot.index] = tensor if len(pack) == 1 else tensor.clone()
    if sending:
        return state, True
    return (fill_tensors(skeleton, received) if keep else None), True


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
