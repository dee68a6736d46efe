"""The MoE router's auxiliary losses, per microbatch and per iteration, as Megatron-LM logs them.

megatron-core's router records each layer's auxiliary losses (the coefficient divided out) in its
MoE metrics tracker during forward (`moe_logging.get_moe_metrics_tracker`): name -> one value
per layer.
Megatron-LM's training_log then averages them: the sum over the iteration's microbatches and
the tracker's layers, over the MoE layers, divided by the microbatches of a data-parallel rank
and averaged over the data-parallel ranks: the global batch's mean.

Here a microbatch's values are read from the tracker around its own forward (`AuxLossRecorder`)
and kept by microbatch id, so an iteration's value is the mean over the microbatches it
committed, whichever replica ran them, and a replica that died takes nothing with it: under
--recover the sums travel in the commit lane with the ledger (`ResilientTrainer`'s side sums),
without it they are summed over the world. One difference from Megatron-LM: its z_loss is the
writing rank's own microbatches' mean (no data-parallel average), here the global batch's.

With tensor parallelism (sequence-parallel, as MoE requires) each TP rank's router sees its
slice of a microbatch's tokens: the load-balancing losses it saves are parts of the
microbatch's (megatron sums them over the TP group), its z_loss is the mean over its own slice
(megatron does not reduce it), so summed over the replica's ranks z_loss is divided by TP.
"""

import torch


def _values(name: str):
    """The per-layer values megatron-core's MoE metrics tracker holds for `name` (a tensor of
    one entry per layer), or None before a router recorded it."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    entry = get_moe_metrics_tracker().metrics.get(name)
    return None if entry is None else entry.values


class AuxLossRecorder:
    """Each microbatch's auxiliary losses, per name and layer, read around its forward."""

    def __init__(self, names: tuple[str, ...], num_layers: int):
        self.names = names
        self.num_layers = num_layers
        self.size = len(names) * num_layers
        self._device: dict[tuple[int, int], torch.Tensor] = {}  # (iteration, id) -> values
        self._pending: list[dict] = []  # finished passes' values, still on the device
        self.values: dict[tuple[int, int], list[float]] = {}

    def before_forward(self) -> None:
        """Empty the tracker: what it holds after the forward is that microbatch's."""
        for name in self.names:
            values = _values(name)
            if values is not None:
                values.zero_()

    def after_forward(self, iteration: int, microbatch_id: int) -> None:
        """Keep the microbatch's values where they are (with model chunks, summed over its
        forwards): no host sync until they are summed."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        parts = []
        for name in self.names:
            values = _values(name)
            parts.append(torch.zeros(self.num_layers, dtype=torch.float64, device=device)
                         if values is None else values.detach().double().clone())
        values = torch.cat(parts)
        key = (iteration, microbatch_id)
        self._device[key] = values + self._device[key] if key in self._device else values

    def pass_done(self) -> None:
        """The pass returned: its values wait on the device until they are summed (`sums`,
        after the reductions), so the pass's end costs no host sync."""
        self._pending.append(dict(self._device))
        self._device.clear()

    def _to_host(self) -> None:
        """The finished passes' values to the host, in one copy."""
        keys = [key for values in self._pending for key in values]
        if keys:
            rows = torch.stack([v for values in self._pending for v in values.values()])
            self.values.update(zip(keys, rows.cpu().tolist()))
        self._pending.clear()

    def sums(self, iteration: int, counts: dict[int, int]) -> list[float]:
        """The values of `counts` (id -> times counted) of `iteration`, summed (those of earlier
        iterations are dropped)."""
        self._to_host()
        self.values = {key: v for key, v in self.values.items() if key[0] >= iteration}
        total = [0.0] * self.size
        for microbatch_id, count in counts.items():
            for index, value in enumerate(self.values.get((iteration, microbatch_id), ())):
                total[index] += count * value
        return total


def iteration_values(moe, num_layers: int, sums: list[float], microbatches: int,
                     tensor_parallel: int = 1) -> dict[str, tuple[float, list[float]]]:
    """name -> (its value, its per-layer values) from the sums over `microbatches` committed
    microbatches and all ranks (`AuxLossRecorder.sums` over the world): Megatron-LM's average
    over the MoE layers and the global batch (nothing for a dense model); `tensor_parallel`:
    the TP size, whose ranks' z_loss values are each a slice's mean (module docstring)."""
    if moe is None or not sums:
        return {}
    moe_layers = max(sum(moe.layer_pattern), 1)
    result = {}
    for index, name in enumerate(names(moe)):
        per_rank = tensor_parallel if name == "z_loss" else 1
        layers = [value / (max(microbatches, 1) * per_rank)
                  for value in sums[index * num_layers:(index + 1) * num_layers]]
        result[name] = (sum(layers) / moe_layers, layers)
    return result


def names(moe) -> tuple[str, ...]:
    """The tracker names this model's routers save."""
    return moe.loss_names if moe is not None else ()
