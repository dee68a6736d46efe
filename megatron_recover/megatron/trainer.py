"""The resilient training step: first pass, reduce, agree, restore or extend, commit, step.

One `ResilientTrainer.train_step(t)` per iteration, on every rank, drives the three layers:

  1. The policy says which microbatch ids this replica runs; `run_pass` runs them through
     megatron's schedule, whose finalize posts every bucket's ulfm all-reduce (layer 2 snapshots
     each bucket first; a spare zeroes its bucket after the snapshot).
  2. The commit lane — this replica's loss sum, contribution count and an order-independent hash
     of its contributed ids — is all-reduced on the same group, then a consensus gives every
     survivor the same failure record. The census says whether each survivor's reductions all
     succeeded under the current epoch.
  3. The iteration commits only when nobody failed since the last consensus and every survivor's
     reductions succeeded. Otherwise the agreed dead replicas go to the policy: a promotion or a
     drop means a blocking restore (rewind every bucket, reduce again under the new membership);
     a boundary means a non-blocking one (rewind, run the extension pass, whose finalize reduces
     again). Failures during any of this loop back to 2.
  4. Commit: the policy installs the next layout; the adaptive policy rescales the summed gradient
     to its committed count; the optimizer steps.

Every decision is a function of agreed records, so all survivors take the same branch.
"""

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_recover.collective import ULFMGroup
from megatron_recover.megatron import hooks
from megatron_recover.policy import ADAPTIVE, IdSet, WorkloadPolicy
from megatron_recover.recovery import GradientRecovery

_HASH_MODULUS = (1 << 31) - 1


def ids_hash(ids: IdSet) -> int:
    """Order-independent hash of a set of microbatch ids (a sum of mixed ids modulo 2^31-1).

    Sums stay exact in float64 for any B below 2^22, so the hash can ride in the commit lane.
    """
    total = 0
    for i in ids:
        x = (i + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        total += (x ^ (x >> 31)) % _HASH_MODULUS
    return total


@dataclass
class StepReport:
    """What one committed iteration did; one JSONL record of the recovery log."""

    iteration: int
    loss: float
    contributions: int
    B: int
    live_replicas: int
    epoch: int
    ids_hash: int
    expected_ids_hash: int
    invariant_ok: bool
    grad_norm: float | None
    iteration_ms: float
    extension_rounds: int
    buckets: int
    events: list[dict] = field(default_factory=list)


@dataclass
class TrainerParts:
    """What the trainer drives. `run_pass(iteration, ids, losses)` runs forward/backward of `ids`
    through megatron's schedule (finalize included), adding each id's loss to `losses`.
    `faults.at(location, iteration)` and `faults.arm_iteration(group, iteration, bucket)` are the
    failure simulator's points (a no-op object when there is no schedule)."""

    model: object  # megatron DistributedDataParallel
    optimizer: object
    scheduler: object | None
    group: ULFMGroup
    policy: WorkloadPolicy
    replica: int
    replica_of_rank: dict[int, int]
    run_pass: Callable[[int, list[int], dict[int, float]], None]
    faults: object
    restore: bool = True  # False: the --recover-no-restore negative control


class ResilientTrainer:
    def __init__(self, parts: TrainerParts, increment_samples: int):
        self.p = parts
        self.increment_samples = increment_samples
        self.dead_replicas: set[int] = set()
        self._iteration = 0
        self.recovery = GradientRecovery(parts.group, before_first_reduce=self._before_reduce)
        hooks.install(parts.group.process_group, self.recovery, loss_divisor=parts.policy.config.b)

    def _before_reduce(self) -> None:
        self.p.faults.at("before-reduce", self._iteration)

    def train_step(self, iteration: int) -> StepReport:
        p = self.p
        self._iteration = iteration
        start = time.perf_counter()
        events = []
        p.faults.arm_iteration(p.group, iteration, bucket_index=2)
        p.policy.begin(iteration)
        work = p.policy.work(p.replica)
        losses: dict[int, float] = {}
        # As Megatron-LM's train_step: the optimizer left param.grad aliasing the grad buffer;
        # without dropping it, backward would add each first microbatch's gradient twice.
        p.model.zero_grad_buffer()
        p.optimizer.zero_grad()
        self.recovery.begin_pass()
        self.recovery.contributing = work.contributes_first_pass
        p.faults.at("pre-forward", iteration)
        self._run(iteration, list(work.first_pass), losses)

        while True:
            failed_locally = bool(self.recovery.wait())
            contributed = work.contributed
            lane = torch.tensor([sum(losses[i] for i in contributed), float(len(contributed)),
                                 float(ids_hash(contributed))], dtype=torch.float64)
            lane_record = p.group.allreduce(lane).wait()
            ok = int(not failed_locally and not lane_record.has_failure
                     and self.recovery.all_reduced() and lane_record.epoch == p.group.epoch)
            agreed = p.group.consensus([ok]).wait()
            new_dead = sorted({p.replica_of_rank[r] for r in agreed.failed_ranks}
                              - self.dead_replicas)
            if not agreed.failed_ranks and agreed.census[0] == agreed.size:
                break
            detected = time.time()
            if new_dead:
                self.dead_replicas.update(new_dead)
                decision = p.policy.on_failure(new_dead)
                work = p.policy.work(p.replica)
                events.append({"event": "failure", "replicas": new_dead,
                               "ranks": list(agreed.failed_ranks), "epoch": agreed.epoch,
                               "detected": detected, "repaired": detected,
                               "restore": decision.restore_mode, "g_ext": decision.g_ext,
                               "promotions": [list(x) for x in decision.promotions]})
                if decision.boundary:
                    self._extension_pass(iteration, work, losses)
                    events[-1]["restored"] = time.time()
                    continue
            else:
                events.append({"event": "retry", "epoch": agreed.epoch, "detected": detected})
            self._blocking_restore(iteration, work)
            events[-1]["restored"] = time.time()

        return self._commit(iteration, lane, agreed, start, events)

    def _run(self, iteration: int, ids: list[int], losses: dict[int, float]) -> None:
        if ids:
            self.p.run_pass(iteration, ids, losses)
        else:
            # Nothing to compute on this replica, but its buckets still take part in the reduce.
            self.p.model.finish_grad_sync()

    def _blocking_restore(self, iteration: int, work) -> None:
        """Rewind every bucket and reduce it again under the new membership and roles."""
        self.p.faults.at("during-restore", iteration)
        self.recovery.begin_pass()
        if self.p.restore:
            self.recovery.rewind()
        self.recovery.contributing = work.contributes_first_pass
        self.recovery.reduce_again(self.recovery.grads)

    def _extension_pass(self, iteration: int, work, losses: dict[int, float]) -> None:
        """Rewind (to zero if nothing this replica ran so far counts), then run the extension."""
        self.recovery.begin_pass()
        extension = work.extension
        counted_before = len(work.contributed) - len(extension)
        if self.p.restore:
            self.recovery.rewind(to_zero=counted_before == 0)
        self.recovery.contributing = True
        self.p.faults.at("during-extension", iteration)
        self._run(iteration, list(extension), losses)

    def _commit(self, iteration, lane, agreed, start, events) -> StepReport:
        p = self.p
        result = p.policy.commit()
        loss_sum, contributions, lane_hash = lane.tolist()
        expected_hash = ids_hash(result.committed)
        invariant_ok = (int(contributions) == result.contributions
                        and int(lane_hash) == expected_hash
                        and (p.policy.config.policy == ADAPTIVE
                             or result.contributions == p.policy.config.b))
        if result.divisor != p.policy.config.b:
            # Losses were divided by B in the schedule; drop-and-go divides by what it committed.
            p.model.scale_gradients(p.policy.config.b / result.divisor)
        p.faults.at("optimizer-step", iteration)
        _, grad_norm, _ = p.optimizer.step()
        if p.scheduler is not None:
            p.scheduler.step(increment=self.increment_samples)
        for event in events:
            event["committed"] = time.time()
        return StepReport(
            iteration=iteration, loss=loss_sum / result.divisor,
            contributions=int(contributions), B=p.policy.config.b,
            live_replicas=len(result.roles), epoch=agreed.epoch, ids_hash=int(lane_hash),
            expected_ids_hash=expected_hash, invariant_ok=invariant_ok,
            grad_norm=None if grad_norm is None else float(grad_norm),
            iteration_ms=(time.perf_counter() - start) * 1e3,
            extension_rounds=len(result.extension_rounds),
            buckets=len(self.recovery.grads), events=events)
