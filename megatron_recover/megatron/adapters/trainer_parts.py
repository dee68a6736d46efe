"""Megatron-core behind the round protocol's interfaces (`megatron_recover.recovery.interfaces`).

`build_trainer` is what the entry point calls: it wraps megatron's DistributedDataParallel (the
gradient buckets), the micro-pass runner (megatron's schedule), the optimizer with its
learning-rate scheduler and the replica's torch groups, routes the patched bucket-group hooks to
the trainer's gradient recovery (`hooks.install`), and returns the protocol's
`ResilientTrainer`. Nothing of the protocol is here: only how megatron is driven.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_recover import errors
from megatron_recover.megatron.adapters import hooks
from megatron_recover.recovery import ResilientTrainer, TrainerParts


class DDPBuffers:
    """megatron-core DDP's gradient buffers as `GradientBuffers`.

    `synced_inside_replica`: the parameters finalize_model_grads syncs inside the replica after
    backward (in every mode); with `overlap_grad_reduce` their buckets are also deferred to
    after the pass."""

    def __init__(self, chunks, overlap_grad_reduce: bool,
                 synced_inside_replica: frozenset = frozenset()):
        self.chunks = list(chunks)
        self.overlap_grad_reduce = overlap_grad_reduce
        # In the order megatron completes them: the last model chunk's backward ends first.
        self._buckets = [bucket for chunk in reversed(self.chunks)
                         for bucket in _completion_order(chunk)]
        self._synced = [bucket.grad_data for bucket in self._buckets
                        if bucket.params & synced_inside_replica]
        # megatron's flag for a parameter all-gather dispatched by the optimizer step: the
        # forward pre-hooks then only wait, and do not dispatch the next bucket group's.
        self.overlap_param_gather = self.chunks[0].use_forward_hook
        if self.overlap_param_gather:
            for chunk in self.chunks:
                chunk.overlap_param_gather_with_optimizer_step = True

    def buckets(self) -> list[torch.Tensor]:
        return [bucket.grad_data for bucket in self._buckets]

    def chunk_buckets(self) -> list[list[torch.Tensor]] | None:
        """Each model chunk's buckets, or None with one chunk (every bucket)."""
        if len(self.chunks) == 1:
            return None
        return [[bucket.grad_data for group in _bucket_groups(chunk) for bucket in group.buckets]
                for chunk in self.chunks]

    def expert_shard_groups(self) -> dict:
        """With distributed-optimizer instances, each expert bucket's shard group by data_ptr:
        the instance's ranks that hold the same experts (megatron's intra-instance expert
        data-parallel group), not the dense buckets' shard group."""
        return {bucket.grad_data.data_ptr(): group.intra_distributed_optimizer_instance_group
                for chunk in self.chunks for group in chunk.expert_parallel_bucket_groups
                for bucket in group.buckets
                if hasattr(group, "intra_distributed_optimizer_instance_group")}

    def synced(self) -> list[torch.Tensor]:
        return list(self._synced)

    def deferred(self) -> list[torch.Tensor]:
        return list(self._synced) if self.overlap_grad_reduce else []

    def zero(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()

    def scale(self, factor: float) -> None:
        for chunk in self.chunks:
            chunk.scale_gradients(factor)

    def new_pass(self) -> None:
        if self.overlap_grad_reduce:
            # megatron counts each parameter's gradient-ready hooks per pass to know when a
            # bucket is complete; start this pass's count from zero (posting stays ours).
            for chunk in self.chunks:
                for bucket_group in _bucket_groups(chunk):
                    bucket_group.reset()

    def dispatch_param_gather(self) -> None:
        if self.overlap_param_gather:
            for chunk in self.chunks:
                chunk.start_param_sync(force_dispatch=True)

    def wait_param_gather(self) -> None:
        if not self.overlap_param_gather:
            return
        for chunk in self.chunks:
            for bucket_group in _bucket_groups(chunk):
                if bucket_group.param_gather_handle is not None:
                    bucket_group.param_gather_handle.wait()
                    bucket_group.param_gather_handle = None


def _bucket_groups(chunk) -> list:
    """A DDP chunk's bucket groups: the dense ones, then the expert ones."""
    return list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)


def _completion_order(chunk) -> list:
    """A DDP chunk's buckets in the order backward completes them, the same on every replica:
    a bucket is complete once the gradient of its parameter used first in forward (the first
    registered) arrived. Dense buckets are megatron's order already (a buffer holds the
    parameters in reverse); the expert buckets (megatron's separate buffer, with
    mixture-of-experts layers) fall in between, so that with --overlap-grad-reduce an expert
    bucket is posted as soon as its layer's backward is done, not after every dense bucket."""
    index = {id(param): i for i, param in enumerate(chunk.module.parameters())}
    buckets = [bucket for group in _bucket_groups(chunk) for bucket in group.buckets]
    return sorted(buckets, key=lambda bucket: -min(index[id(p)] for p in bucket.params))


def bucket_kinds(chunks) -> list[str]:
    """"dense" or "expert" for each bucket of `chunks` (megatron's DDP model chunks), in the
    order `DDPBuffers` reduces them."""
    expert = {id(bucket) for chunk in chunks for group in chunk.expert_parallel_bucket_groups
              for bucket in group.buckets}
    return ["expert" if id(bucket) in expert else "dense"
            for chunk in reversed(list(chunks)) for bucket in _completion_order(chunk)]


class MegatronOptimizer:
    """megatron-core's optimizer and its OptimizerParamScheduler as `OptimizerStep`."""

    def __init__(self, optimizer, scheduler, micro_batch_size: int):
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.micro_batch_size = micro_batch_size

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self, microbatches: int) -> tuple[bool, float | None]:
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful and self.scheduler is not None:
            # As Megatron-LM: a skipped step consumed its samples but does not move the lr.
            self.scheduler.step(increment=microbatches * self.micro_batch_size)
        return update_successful, grad_norm

    def loss_scale(self) -> float:
        return float(self.optimizer.get_loss_scale())


class TorchControl:
    """A torch.distributed group as a `ControlGroup` (the tensors are CPU float64: the group
    must be a gloo one, a control group of groups.py, never megatron's own on a GPU)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def max(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)


class SchedulePass:
    """The micro-pass runner (`gpt.MicrobatchPass.run`) as a `PassRunner`: the divisor goes to
    the patched schedules' loss hook; what the rank runs goes to `errors.note` (an error's
    report names its iteration and microbatch)."""

    def __init__(self, run):
        self._run = run

    def __call__(self, iteration, ids, divisor, losses, tokens, padding, sink) -> None:
        hooks.set_loss_divisor(divisor)
        errors.note(iteration)  # the forward step notes each microbatch it consumes
        self._run(iteration, ids, losses, tokens, padding, sink)
        errors.note(iteration)


def build_trainer(*, chunks, optimizer, scheduler, micro_batch_size: int, run_pass,
                  replica_group, shard_group, shard_control_group, overlap_grad_reduce: bool,
                  synced_inside_replica: frozenset, **parts) -> ResilientTrainer:
    """The trainer of this rank over megatron's objects; `parts` are the remaining
    `TrainerParts` fields (group, policy, replica, replica_of_rank, faults, audit, ...).
    `replica_group`: the replica's control group (gloo), None when the replica is one rank;
    `shard_group`: the training group the buckets reduce-scatter on, `shard_control_group` its
    gloo mirror (groups.py)."""
    buffers = DDPBuffers(chunks, overlap_grad_reduce, synced_inside_replica)
    trainer = ResilientTrainer(TrainerParts(
        buffers=buffers, run_pass=SchedulePass(run_pass),
        optimizer=MegatronOptimizer(optimizer, scheduler, micro_batch_size),
        replica_control=None if replica_group is None else TorchControl(replica_group),
        shard_group=shard_group,
        shard_control=None if shard_group is None else TorchControl(shard_control_group),
        bucket_shard_groups=buffers.expert_shard_groups() if shard_group is not None else None,
        overlap_grad_reduce=overlap_grad_reduce, **parts))
    hooks.install(trainer.p.group.process_group, trainer.recovery)
    buffers.dispatch_param_gather()  # the first forward's pre-hooks wait for it
    return trainer
