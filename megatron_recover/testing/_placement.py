"""Which host memory stands for device memory under the CPU emulation (used by `cpu_emulation`).

Under emulation every "CUDA" tensor is a CPU tensor, so `tensor.device` cannot tell a batch that
was moved to the device from one that was not. `Placements` remembers the storages that were
placed on an emulated device:

- created there (a factory or `new_*` method given a CUDA device, a `*_like` factory or
  `clone()` of a placed tensor), or
- moved there (`.cuda()`, `.to("cuda")`, `.to(placed_tensor)`); as on a GPU, moving a host
  tensor returns a new tensor on its own storage and leaves the host tensor where it was.

Views and `detach()` share their base's storage, so they are placed with it. Results of other
operations are not tracked: `on_device` answers for what a program places (parameters, batches,
buffers, snapshots), not for every intermediate value.

A storage is remembered through a weak reference to its StorageImpl: the record expires with the
storage, and the address cannot be reused for another storage while the record exists, so a
host tensor never inherits a freed device tensor's mark.
"""

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def _key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): not tracked
        return None


class Placements:
    """The emulated device's storages."""

    def __init__(self):
        self._placed: dict[int, StorageWeakRef] = {}
        self._prune_at = 1024

    def mark(self, tensor):
        """Record `tensor`'s storage as device memory; returns `tensor`."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        key = _key(tensor)
        if key is not None and not self.on_device(tensor):
            self._placed[key] = StorageWeakRef(tensor.untyped_storage())
            if len(self._placed) >= self._prune_at:
                self._placed = {k: ref for k, ref in self._placed.items() if not ref.expired()}
                self._prune_at = max(1024, 2 * len(self._placed))
        return tensor

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives in memory placed on an emulated device."""
        key = _key(tensor)
        ref = self._placed.get(key) if key is not None else None
        return ref is not None and not ref.expired()
