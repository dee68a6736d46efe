"""A training state over a ulfm group: its structure, then its tensors in packs.

`broadcast_state` sends a state (tensors and plain objects, nested in dicts, lists and tuples)
from a donor to every member, tensor by tensor, without ever holding it serialized; a standby's
join (`standby.transfer`) and a snapshot's hand-over to a relaunched rank use it.
`to_bytes`/`from_bytes` serialize small objects. What a state holds is the caller's (the glue's
`persistence/training_state.py` defines a rank's).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import torch


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
