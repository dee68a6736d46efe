"""The functions our megatron-core patches call. Nothing here imports megatron.

Stock behaviour unless a `GradientRecovery` was installed for a data-parallel group
(`install()`): then megatron does not reduce that group's buckets at all — the trainer posts the
cross-replica reductions itself once the schedule returned, after the pipeline flush and the
intra-replica embedding sync (the paper's deferred path), so a bucket's snapshot holds the
replica's complete gradient and a rewind never has to redo an intra-replica step — and the
schedules divide each microbatch loss by the iteration's global microbatch count B
(`set_loss_divisor`). With --overlap-grad-reduce, megatron's own signal that a bucket group's
gradients are complete (its start_grad_sync, from the backward of the last microbatch) goes to
layer 2, which posts the bucket there unless megatron syncs it inside the replica after
backward (`GradientRecovery.bucket_ready`). With distributed-optimizer instances the
intra-instance reduce-scatter is the trainer's too (layer 2 snapshots the bucket before it).
The schedules also divide megatron's MoE auxiliary-loss gradient scale by `loss_divisor`, and
its auxiliary-loss scaler asks `in_padding` when a loss is attached: a padding microbatch's get
a zero gradient (`aux_loss_backward_scale`). Only what megatron's patched code must reach is
here: our own pass runner is handed the recovery it reports microbatches to
(`interfaces.LedgerSink`).
"""

from contextlib import contextmanager

_recoveries = {}  # id(data-parallel process group) -> GradientRecovery
_loss_divisor = None
_padding = False  # the forward running now is a padding microbatch's


def install(process_group, recovery) -> None:
    """Route the bucket reductions of `process_group` through `recovery`."""
    _recoveries[id(process_group)] = recovery


def set_loss_divisor(b: int) -> None:
    """Divide each microbatch loss of the coming passes by `b`, the iteration's B."""
    global _loss_divisor
    _loss_divisor = b


def _cross_replica_group(bucket_group):
    """Its data-parallel group or, with distributed-optimizer instances, its inter-instance
    group."""
    group = getattr(bucket_group, "data_parallel_group", None)  # absent with the dist. optimizer
    if group is None:
        group = getattr(bucket_group, "inter_distributed_optimizer_instance_group", None)
    return group


def owns(bucket_group) -> bool:
    """True when this bucket group's cross-replica reduction belongs to megatron-recover."""
    return bool(_recoveries) and id(_cross_replica_group(bucket_group)) in _recoveries


def start_grad_sync(bucket_group) -> None:
    """Megatron found the bucket group's gradients complete (--overlap-grad-reduce, in the last
    microbatch's backward): layer 2 posts what is due (nothing outside an overlapped first
    pass); the rest is posted by the trainer after the schedule."""
    recovery = _recoveries[id(_cross_replica_group(bucket_group))]
    recovery.bucket_ready([bucket.grad_data for bucket in bucket_group.buckets])


def finish_grad_sync(bucket_group) -> None:
    """Nothing: see start_grad_sync. Nor is the bucket group's parameter all-gather marked as
    not dispatched, as megatron does after every pass: with --overlap-param-gather the trainer
    dispatches it once per iteration, after the optimizer step, on every shard of an instance
    (`adapter.DDPBuffers.dispatch_param_gather`), so that neither an extension pass nor a shard
    that runs no microbatch issues an all-gather its peers do not."""


def loss_divisor(num_microbatches: int) -> int:
    return num_microbatches if _loss_divisor is None else _loss_divisor


@contextmanager
def padding_forward(padding: bool):
    """Around a microbatch's forward: whether it is padding (it trains on nothing: its loss
    mask is empty, and the MoE auxiliary losses attached in it get a zero gradient)."""
    global _padding
    _padding = padding
    try:
        yield
    finally:
        _padding = False


def in_padding() -> bool:
    """Read by megatron's MoE auxiliary-loss scaler when it attaches a loss in a forward."""
    return _padding


def aux_loss_backward_scale(scale, padding: bool):
    """The gradient megatron's MoE auxiliary-loss scaler gives a loss attached in a forward
    (`padding`: in a padding microbatch's): its scale, or zero for padding."""
    return scale * 0 if padding else scale
