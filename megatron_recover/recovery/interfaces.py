"""What the round protocol (`round.Round`) drives, as typed interfaces.

The protocol knows nothing of megatron: `megatron_recover.megatron.adapters.trainer_parts` implements these
over megatron-core's DDP, schedules and optimizer, and the unit tier (`megatron_recover.testing`)
implements them in one process. Each method says what the protocol relies on.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from megatron_recover.recovery.ledger import LaneTotals


class GradientBuffers(Protocol):
    """The model's gradient buckets: contiguous tensors the backward accumulates into."""

    def buckets(self) -> list[torch.Tensor]:
        """Every bucket, in the order all members reduce them (the same on every rank of a
        position, across replicas)."""

    def synced(self) -> list[torch.Tensor]:
        """The buckets megatron syncs in place inside the replica after backward, in every
        reduction mode (a tied embedding across pipeline stages, sequence-parallel norms); a
        subset of `buckets()`."""

    def chunk_buckets(self) -> list[list[torch.Tensor]] | None:
        """With virtual pipeline stages, each model chunk's buckets; None with one chunk."""

    def deferred(self) -> list[torch.Tensor]:
        """The buckets posted only after the pass: with an overlapped reduction the `synced()`
        ones (so a reduction in flight never races their sync), otherwise none."""

    def zero(self) -> None:
        """A new iteration: every bucket zero (Megatron-LM's train_step zeroes the DDP buffer,
        then the optimizer's grads: `OptimizerStep.zero_grad`)."""

    def scale(self, factor: float) -> None:
        """Multiply every bucket by `factor` (the reduced gradient, before the step)."""

    def new_pass(self) -> None:
        """A further pass begins in the same iteration: forget which buckets the last one found
        complete (an overlapped pass counts each parameter's ready hooks from zero)."""

    def dispatch_param_gather(self) -> None:
        """After a step: post the parameter all-gathers inside the replica (asynchronous; no-op
        without overlapped parameter gathers)."""

    def wait_param_gather(self) -> None:
        """Wait for those all-gathers: parameters then hold the last step's values."""


class LedgerSink(Protocol):
    """What a pass runner reports as the schedule consumes microbatches (layer 2's
    `GradientRecovery` is one)."""

    def register(self, iteration: int, microbatch_id: int, checksum: int, chunk: int = 0) -> None:
        """The schedule consumed this microbatch (the batch names its own iteration and id;
        `checksum` of its tokens, labels and loss mask) in model chunk `chunk`."""

    def restored(self) -> None:
        """A forward was enqueued: gradients are written from here on, so a pending side-stream
        rewind of the buckets must come first."""


class PassRunner(Protocol):
    def __call__(self, iteration: int, ids: list[int], divisor: int,
                 losses: dict[int, float], tokens: dict[int, int], padding: int,
                 sink: LedgerSink) -> None:
        """Forward and backward of microbatches `ids` of `iteration`, then of `padding`
        microbatches that train on nothing (exactly zero gradient, never registered; the pass
        is not empty: ids or padding), each loss divided by `divisor` (the iteration's B),
        accumulated into the buckets; reports each consumed microbatch to `sink` (and each
        forward, `sink.restored`); adds each id's loss summed over its loss tokens to `losses`
        and their count to `tokens` where this rank sees losses (the logged loss is the
        committed sum over the committed tokens). Raises for a rank-local error."""


class OptimizerStep(Protocol):
    def zero_grad(self) -> None:
        """Drop gradients the optimizer holds outside the buckets."""

    def step(self, microbatches: int) -> tuple[bool, float | None]:
        """Step on the reduced buckets; the learning-rate schedule advances by `microbatches`
        microbatches only when the update was applied. Returns (applied, grad norm)."""

    def loss_scale(self) -> float:
        """The loss scale after the step (1.0 without fp16 scaling)."""


class ControlGroup(Protocol):
    """Float64 collectives among the ranks of one replica (control data, never model data).
    Raises when a peer died: the caller's rank then leaves with its replica (the replica gate).
    Today the adapter runs them on the replica's megatron groups (gloo on CPU); a GPU run
    needs CPU groups of their own for them."""

    rank: int
    size: int

    def sum(self, tensor: torch.Tensor) -> None:
        """In-place element-wise sum over the group's ranks."""

    def max(self, tensor: torch.Tensor) -> None:
        """In-place element-wise maximum over the group's ranks."""


class Audit(Protocol):
    """The per-iteration invariant, computed without the policy."""

    def share(self, iteration: int, index: int, count: int) -> dict[int, tuple[int, int]]:
        """This rank's share of the expected side: (dataset checksum, loss tokens) of the main
        ids k with k % count == index (`index` of `count` contributors to the lane)."""

    def problems(self, iteration: int, totals: LaneTotals, divisor: int,
                 tokens: int | None = None,
                 expected: dict[int, tuple[int, int]] | None = None) -> list[str]:
        """What is wrong with the summed ledger `totals` (empty: the invariant holds);
        `expected`: the shares summed by the lane (None: computed here, every id)."""

    def committed(self, totals: LaneTotals) -> None:
        """The iteration committed with `totals`."""


class FaultPoints(Protocol):
    """The failure simulator's points (a no-op object when a run has no schedule)."""

    def at(self, location: str, iteration: int) -> None:
        """A named point of the round was reached (may kill or stall this rank)."""

    def corrupt(self, iteration: int, grad: torch.Tensor) -> None:
        """Before the first reduction of a pass is posted: flip a bit of `grad` if a `bitflip`
        is due (the failure schedule's silent corruption)."""

    def arm_iteration(self, group, iteration: int, bucket_index: int) -> None:
        """Arm the group's native points for `iteration` (the k-th bucket's reduce)."""

    def slow_down(self, iteration: int, microbatches: int, seconds: Callable[[], float]) -> None:
        """A pass of `microbatches` just ran, in `seconds()` (called only when needed: on CUDA
        it waits for the pass's kernels): sleep as much longer as a slowed device would have
        taken (the failure schedule's `slow` action)."""
