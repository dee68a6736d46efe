"""The functions our megatron-core patches call. Nothing here imports megatron.

Stock behaviour unless a `GradientRecovery` was installed for a data-parallel group
(`install()`): then megatron does not reduce that group's buckets at all — the trainer posts the
cross-replica reductions itself once the schedule returned, after the pipeline flush and the
intra-replica embedding sync (the paper's deferred path), so a bucket's snapshot holds the
replica's complete gradient and a rewind never has to redo an intra-replica step — and the
schedules divide each microbatch loss by the iteration's global microbatch count B
(`set_loss_divisor`). With
distributed-optimizer instances the intra-instance reduce-scatter is the trainer's too (layer 2
snapshots the bucket before it).
"""

_recoveries = {}  # id(data-parallel process group) -> GradientRecovery
_loss_divisor = None


def install(process_group, recovery) -> None:
    """Route the bucket reductions of `process_group` through `recovery`."""
    _recoveries[id(process_group)] = recovery


def set_loss_divisor(b: int) -> None:
    """Divide each microbatch loss of the coming passes by `b`, the iteration's B."""
    global _loss_divisor
    _loss_divisor = b


def owns(bucket_group) -> bool:
    """True when this bucket group's cross-replica reduction belongs to megatron-recover: its
    data-parallel group or, with distributed-optimizer instances, its inter-instance group."""
    if not _recoveries:
        return False
    group = getattr(bucket_group, "data_parallel_group", None)  # absent with the dist. optimizer
    if group is None:
        group = getattr(bucket_group, "inter_distributed_optimizer_instance_group", None)
    return id(group) in _recoveries


def start_grad_sync(bucket_group) -> None:
    """Nothing: the trainer posts the cross-replica reduction after the schedule (deferred)."""


def finish_grad_sync(bucket_group) -> None:
    """Nothing: see start_grad_sync. Nor is the bucket group's parameter all-gather marked as
    not dispatched, as megatron does after every pass: with --overlap-param-gather the trainer
    dispatches it once per iteration, after the optimizer step, on every shard of an instance
    (`ResilientTrainer._dispatch_param_gather`), so that neither an extension pass nor a shard
    that runs no microbatch issues an all-gather its peers do not."""


def register_microbatch(iteration: int, microbatch_id: int, checksum: int) -> None:
    """The schedule consumed this microbatch: its gradient goes into this rank's buckets (the
    gradient ledger of layer 2). Nothing without an installed recovery."""
    for recovery in _recoveries.values():
        recovery.register(iteration, microbatch_id, checksum)


def loss_divisor(num_microbatches: int) -> int:
    return num_microbatches if _loss_divisor is None else _loss_divisor
