"""The resilient trainer of one rank: the round core (`round.py`) with its registered checks
(`checks/`), and what happens between iterations (an evaluation, a join).

`ResilientTrainer.train_step(t)` runs one round per iteration on every rank, over the interfaces
of `interfaces.py` (megatron's DDP, schedule and optimizer behind the adapter of
`megatron_recover.megatron.adapters.trainer_parts`; fakes in the unit tier). `TrainerParts` is what it drives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_recover.collective import ULFMGroup
from megatron_recover.policy import WorkloadPolicy
from megatron_recover.recovery.checks import registered
from megatron_recover.recovery.interfaces import (
    Audit,
    ControlGroup,
    FaultPoints,
    GradientBuffers,
    OptimizerStep,
    PassRunner,
)
from megatron_recover.recovery.lane import LaneHead
from megatron_recover.recovery.report import StepReport
from megatron_recover.recovery.rerun import OFF
from megatron_recover.recovery.round import Round, share
from megatron_recover.recovery.verification import Verification

__all__ = ["ResilientTrainer", "StepReport", "TrainerParts", "share"]


@dataclass
class TrainerParts:
    """What the trainer drives (see `interfaces.py` for each contract)."""

    buffers: GradientBuffers
    run_pass: PassRunner
    optimizer: OptimizerStep
    group: ULFMGroup  # this position's cross-replica group
    policy: WorkloadPolicy
    replica: int  # this rank's replica id
    replica_of_rank: dict[int, int]  # world rank -> replica id, for the group's members
    faults: FaultPoints
    audit: Audit
    computes_loss: bool = True  # False on pipeline stages before the last: they see no losses
    # The replica's ranks (TP x PP, x its shards with instances) for the verdict; None: one rank.
    replica_control: ControlGroup | None = None
    # Distributed-optimizer instances (HSDP): the replica's data-parallel ranks at this rank's
    # TP x PP position. They split the replica's microbatches and reduce-scatter its buckets:
    # `shard_group` is the torch group the buckets reduce-scatter on, `shard_control` the
    # control group of the same ranks.
    shard_group: object | None = None
    shard_control: ControlGroup | None = None
    # Buckets sharded over another group than `shard_group`, by data_ptr (expert buckets).
    bucket_shard_groups: dict | None = None
    # The shards exchange activations in every forward (expert parallelism inside the replica):
    # every shard then runs passes of one length, the longest share, its shorter shares padded
    # with microbatches that train on nothing (the pass runner's `padding`).
    shards_in_step: bool = False
    restore: bool = True  # False: the --recover-no-restore negative control
    per_token_loss: bool = False  # --calculate-per-token-loss
    overlap_grad_reduce: bool = False  # post first-pass buckets during backward
    # Megatron's check_for_nan_in_loss_and_grad on the buckets: a non-finite one raises
    # `failures.NonFiniteResult` before its reduction is posted.
    check_finite: bool = False
    # Whether this rank asks to stop after the iteration; the request rides in the commit lane,
    # so all survivors agree.
    wants_exit: Callable[[], bool] = lambda: False
    # Replicas known dead when the trainer starts (a standby joining a run takes its donor's).
    dead_replicas: frozenset[int] = frozenset()
    # Sampled cross-replica verification (`verification.py`); None: off.
    verification: Verification | None = None
    # --recover-nonfinite-rerun (`rerun.py`): off (a non-finite bucket raises), evict or keep.
    nonfinite_rerun: str = OFF
    # The samples of microbatch id k of iteration t, for the message that ends a job on data
    # that gives a non-finite gradient anywhere; None: the message gives the ids alone.
    samples_of: Callable[[int, int], range] | None = None
    # Side values of each microbatch, summed like its loss over the committed ledger and then
    # over the replica's ranks (the MoE auxiliary losses): `side_sums(iteration, id -> count)`
    # gives `side_size` values.
    side_size: int = 0
    side_sums: Callable[[int, dict[int, int]], list[float]] | None = None


class ResilientTrainer:
    """One rank's trainer: `train_step` runs the round; `evaluate` and `grow` run between
    iterations on the same membership."""

    def __init__(self, parts: TrainerParts):
        self.p = parts
        self.round = Round(parts, registered(parts))

    @property
    def recovery(self):
        """Layer 2 of this rank (`gradients.GradientRecovery`): megatron's hooks post into it."""
        return self.round.recovery

    @property
    def dead_replicas(self) -> set[int]:
        return self.round.dead_replicas

    @property
    def shard(self) -> tuple[int, int]:
        """(this rank's shard, shards) of its replica's data-parallel ranks: (0, 1) without
        distributed-optimizer instances."""
        return self.round.shard, self.round.shards

    def train_step(self, iteration: int) -> StepReport:
        return self.round.step(iteration)

    def gather_parameters(self) -> None:
        """Wait for this rank's parameter all-gathers: the model's parameters are then the ones
        the last step produced on every shard (nothing to do without overlapped gathers)."""
        self.p.buffers.wait_param_gather()

    def add_event(self, event: dict) -> None:
        """An event between iterations (a join): reported with the next committed iteration."""
        self.round.pending_events.append(event)

    def grow(self, joined: dict[int, int], lost_ranks: list[int],
             dead_replicas: set[int] = frozenset()) -> dict | None:
        """Between iterations: the ranks `joined` (world rank -> replica id, on this rank's
        group already) took dead replicas' ids, and the group lost `lost_ranks` (agreed) while
        they joined, and the replicas `dead_replicas` lost a rank at another position; the
        policy lays out the grown set without the replicas lost. Returns the failure event of
        those, if any."""
        self.p.policy.grow(set(joined.values()))
        self.p.replica_of_rank.update(joined)
        self.dead_replicas.difference_update(joined.values())
        ranks = [r for r in lost_ranks if r not in joined and r in self.p.replica_of_rank]
        dead = sorted(({self.p.replica_of_rank[r] for r in ranks} | set(dead_replicas))
                      - self.dead_replicas)
        if not dead:
            return None
        self.dead_replicas.update(dead)
        self.p.policy.drop(dead)
        return {"event": "failure", "replicas": dead, "ranks": ranks,
                "epoch": self.p.group.epoch, "detected": time.time(), "during": "join"}

    def evaluate(self, run_ids: Callable[[list[int], int], torch.Tensor],
                 count: int) -> tuple[torch.Tensor, list[dict]]:
        """An evaluation between iterations: the live replicas split the ids 0..count-1
        (replica i of W runs i, i + W, ...; a replica's shards every S-th of those), and
        `run_ids(ids, padding)` returns this rank's float64 slot vector (with shards in step,
        `padding` microbatches that count nothing follow the ids). The vectors are summed over the
        replicas' ulfm group; a failure anywhere makes every survivor drop the dead replicas
        from the policy's layout (as an iteration boundary would) and evaluate again on the new
        split. Returns the summed vector, on every rank of every live replica, and the failure
        events."""
        p = self.p
        events = []
        nothing = LaneHead(0.0, 0, False)
        while True:
            live = sorted(p.policy.layout.replicas)
            values = run_ids(*self.round.share(range(live.index(p.replica), count, len(live))))
            if p.shard_control is not None:
                p.shard_control.sum(values)  # the shards split the replica's ids
            record = p.group.allreduce(values).wait()
            ok = int(not record.has_failure and record.epoch == p.group.epoch)
            agreed = p.group.consensus([ok]).wait()
            round_ok = not agreed.failed_ranks and agreed.census[0] == agreed.size
            verdict = self.round.verdict(agreed, nothing, not round_ok)
            if verdict.commit:
                self.round.last_progress = time.time()
                break
            new_dead = sorted(verdict.dead - self.dead_replicas)
            if new_dead:
                self.dead_replicas.update(new_dead)
                p.policy.drop(new_dead)
                events.append({"event": "failure", "replicas": new_dead,
                               "ranks": list(agreed.failed_ranks), "epoch": agreed.epoch,
                               "detected": time.time(), "during": "evaluation"})
        if p.replica_control is not None:
            # Only the last pipeline stage ran the loss: the others hold zeros.
            p.replica_control.max(values)
        return values, events
