"""The functions our megatron-core patches call. Nothing here imports megatron.

Stock behaviour unless a `GradientRecovery` was installed for a data-parallel group
(`install()`): then that group's bucket reductions go through layer 2, and the schedules divide
each microbatch loss by the fixed global microbatch count B instead of the local count.
"""

_recoveries = {}  # id(data-parallel process group) -> GradientRecovery
_loss_divisor = None


def install(process_group, recovery, loss_divisor: int) -> None:
    """Route the bucket reductions of `process_group` through `recovery`; divide losses by B."""
    global _loss_divisor
    _recoveries[id(process_group)] = recovery
    _loss_divisor = loss_divisor


def uninstall() -> None:
    global _loss_divisor
    _recoveries.clear()
    _loss_divisor = None


def owns(bucket_group) -> bool:
    """True when this bucket group's cross-replica reduction belongs to megatron-recover."""
    group = getattr(bucket_group, "data_parallel_group", None)  # absent with the dist. optimizer
    return bool(_recoveries) and id(group) in _recoveries


def start_grad_sync(bucket_group) -> None:
    """Post the group's bucket reductions (snapshot, spare zeroing, ulfm all-reduce); no waiting."""
    recovery = _recoveries[id(bucket_group.data_parallel_group)]
    for bucket in bucket_group.buckets:
        recovery.reduce_bucket(bucket.grad_data)


def finish_grad_sync(bucket_group) -> None:
    """Post what is not yet posted. The trainer waits and handles failures after the schedule."""
    recovery = _recoveries[id(bucket_group.data_parallel_group)]
    for bucket in bucket_group.buckets:
        if not recovery.is_posted(bucket.grad_data):
            recovery.reduce_bucket(bucket.grad_data)


def loss_divisor(num_microbatches: int) -> int:
    return num_microbatches if _loss_divisor is None else _loss_divisor
