"""The training loop of pretrain_gpt_recover.py: one loop, in Megatron-LM's order, over a stepper
that runs one iteration — `StockStepper` (Megatron's own data parallelism) or `ResilientStepper`
(--recover: the round protocol of `recovery/`, which commits each iteration on the live
replicas).

After each step, as Megatron-LM's training loop: the iteration line and TensorBoard values, an
evaluation when one is due, a checkpoint when one is due, the exit checks (`Progress`); the
evaluations at the end of training. A stepper adds what its mode does between iterations (the
resilient one: the recovery log, node snapshots, standby joins).
"""

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_recover.megatron.persistence import (
    torch_format as checkpoint,
    common as checkpoint_common,
    torch_dist as dist_checkpoint,
    loading,
)
from megatron_recover.megatron.adapters import groups, moe_losses
from megatron_recover.megatron.persistence import training_state
from megatron_recover.megatron.app.progress import ExitRequests, Progress
from megatron_recover.megatron.app.rank_setup import RankSetup
from megatron_recover.megatron.app.report import RecoverLog
from megatron_recover.recovery import ResilientTrainer
from megatron_recover.recovery.protocol_state import capture

# Records of committed iterations a rank keeps until it sees them written (recovery log).
PENDING_RECORDS = 1000


@dataclass
class StepResult:
    """One iteration as the loop reports it."""

    loss: float
    grad_norm: float | None
    iteration_ms: float
    skipped: bool  # the fp16 loss scaler skipped the optimizer step
    global_batch_size: int
    events: list = field(default_factory=list)  # failures and joins (--recover)
    recover: dict | None = None  # the recovery columns of the iteration line (--recover)
    exit_requested: bool = False  # every live rank agreed, in the step, to stop after it
    # The MoE auxiliary losses: name -> (value, per-layer values) (moe_losses.py)
    aux_losses: dict = field(default_factory=dict)


def run_loop(cfg, progress: Progress, stepper) -> list[int]:
    """Iterations `stepper.first_iteration` .. --train-iters, or until an --exit-* flag stops
    every rank after the same one; returns the iterations whose step the fp16 loss scaler
    skipped."""
    skipped = []
    iteration = stepper.first_iteration - 1
    for iteration in range(stepper.first_iteration, cfg.train_iters + 1):
        result = stepper.step(iteration)
        if result.skipped:
            skipped.append(iteration)
        progress.after_iteration(iteration, loss=result.loss, skipped=result.skipped,
                                 iteration_ms=result.iteration_ms,
                                 global_batch_size=result.global_batch_size,
                                 grad_norm=result.grad_norm, events=result.events,
                                 recover=result.recover, aux_losses=result.aux_losses,
                                 first=iteration == stepper.first_iteration)
        if cfg.evaluation.due(iteration):
            progress.evaluate(iteration)
        saved = progress.save_due(iteration)
        if saved:
            stepper.save(iteration)
        stepper.committed(iteration)
        if progress.stopping(iteration, stepper.exit_agreed(result), saved,
                             lambda: stepper.save(iteration)):
            break
        if iteration < cfg.train_iters:
            stepper.between(iteration)
    else:
        progress.end_of_training(iteration)
    stepper.finish()
    return skipped


class StockStepper:
    """Plain Megatron data parallelism: each data-parallel rank runs its contiguous slice of the
    iteration's microbatch ids and DDP averages the gradients; megatron-core's microbatch
    calculator gives each iteration's count; --save/--load are megatron-core distributed
    checkpoints."""

    def __init__(self, cfg, rank: int, setup: RankSetup, micro_pass, exits: ExitRequests):
        from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

        self.cfg = cfg
        self.setup = setup
        self.micro_pass = micro_pass
        self.exits = exits
        # As Megatron-LM core_v0.19.0's set_global_variables: the schedule's thresholds in
        # tokens of --seq-length.
        init_num_microbatches_calculator(
            rank, None, cfg.global_batch_size, cfg.micro_batch_size, cfg.data_parallel_size,
            step_batch_size_schedule=cfg.step_batch_size_schedule,
            seq_length=cfg.model.seq_length)
        self.first_iteration = 1
        start = time.time()
        plan = loading.plan(cfg.checkpoint, say=loading.printer(rank))
        if plan is not None:
            self.first_iteration = dist_checkpoint.load(plan, *self._state(), cfg)[0] + 1
        elif cfg.checkpoint.load:
            dist_checkpoint.nothing_to_load(cfg.checkpoint.load, start)
        self.consumed = cfg.global_batches.first_sample(self.first_iteration)
        self.saves = dist_checkpoint.AsyncSaves() if cfg.checkpoint.async_save else None

    def _state(self):
        return self.setup.chunks, self.setup.optimizer, self.setup.scheduler

    def step(self, iteration: int) -> StepResult:
        """One iteration over the same ids as the policy's. As Megatron-LM, the logged loss is
        the global batch's loss sum over its loss tokens (with or without
        --calculate-per-token-loss)."""
        from megatron.core.num_microbatches_calculator import (
            get_current_global_batch_size,
            get_num_microbatches,
            update_num_microbatches,
        )

        cfg, setup = self.cfg, self.setup
        update_num_microbatches(self.consumed, consistency_check=True)
        # Megatron's sampler order: data-parallel rank r's m-th microbatch is slice m * dp + r.
        dp = cfg.data_parallel_size
        ids = [m * dp + setup.dp_rank for m in range(get_num_microbatches())]
        global_batch_size = get_current_global_batch_size()
        start = time.perf_counter()
        for chunk in setup.chunks:
            chunk.zero_grad_buffer()
        setup.optimizer.zero_grad()
        losses, tokens = {}, {}
        self.micro_pass.run(iteration, ids, losses, tokens)
        update_successful, grad_norm, _ = setup.optimizer.step()
        if update_successful:  # as Megatron-LM: a step skipped by the fp16 loss scaler keeps lr
            setup.scheduler.step(increment=global_batch_size)
        aux = self.micro_pass.aux_losses
        side = [] if aux is None else aux.sums(iteration, dict.fromkeys(ids, 1))
        total = torch.tensor([sum(losses.values()), sum(tokens.values()), *side],
                             dtype=torch.float64)
        # Over the world: TP ranks' auxiliary-loss pieces, stages' layers, ranks' microbatches.
        dist.all_reduce(total, group=groups.world_control())
        self.consumed += global_batch_size
        return StepResult(loss=total[0].item() / max(total[1].item(), 1), grad_norm=grad_norm,
                          iteration_ms=(time.perf_counter() - start) * 1e3,
                          skipped=not update_successful, global_batch_size=global_batch_size,
                          aux_losses=moe_losses.iteration_values(
                              cfg.model.moe, cfg.model.num_layers, total[2:].tolist(),
                              global_batch_size // cfg.micro_batch_size,
                              cfg.parallel.tensor_model_parallel_size))

    def save(self, iteration: int) -> None:
        gather_parameters(self.setup.chunks)
        dist_checkpoint.save(self.cfg.checkpoint.save, iteration, *self._state(),
                             checkpoint_common.megatron_common(self.cfg, iteration,
                                                             self.setup.padded_vocab_size),
                             saves=self.saves)

    def committed(self, iteration: int) -> None:
        if self.saves is not None:
            self.saves.poll()  # an --async-save whose writers all ended completes

    def exit_agreed(self, result: StepResult) -> bool:
        """As Megatron-LM: the maximum of every rank's request."""
        del result
        if not self.cfg.exit.agreed:
            return False
        flag = torch.tensor([float(self.exits.requested())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=groups.world_control())
        return bool(flag.item() > 0)

    def between(self, iteration: int) -> None:
        pass

    def finish(self) -> None:
        if self.saves is not None:
            self.saves.poll(blocking=True)
        gather_parameters(self.setup.chunks)


class ResilientStepper:
    """--recover: `ResilientTrainer` commits each iteration on the live replicas. The writer (the
    lowest live rank) appends the recovery log; a checkpoint is written by the lowest live
    replica; with --recover-snapshot-interval every rank keeps in-memory snapshots; with standby
    replicas, `grow_back(iteration)` calls them into vacant replica ids between iterations."""

    def __init__(self, cfg, rank: int, setup: RankSetup, trainer: ResilientTrainer,
                 first_iteration: int, progress: Progress, snapshots=None, grow_back=None,
                 joined: dict | None = None):
        self.cfg = cfg
        self.setup = setup
        self.trainer = trainer
        self.first_iteration = first_iteration
        self.progress = progress
        self.snapshots = snapshots
        self.grow_back = grow_back
        self.joined = joined  # a standby that joined: its join, as it saw it
        self.log = RecoverLog(cfg.recover.log if rank == 0 else None,
                              last_written=first_iteration - 1)
        # Committed iterations whose records this rank has not seen written. Writers can die
        # after a commit and before their record is out, several in a row; whoever writes next
        # writes what the log lacks (bounded: a chain of PENDING_RECORDS writer deaths is not
        # survived in full).
        self.pending = deque(maxlen=PENDING_RECORDS)
        self.saves = dist_checkpoint.AsyncSaves() if cfg.checkpoint.async_save else None

    def step(self, iteration: int) -> StepResult:
        cfg = self.cfg
        lr = self.setup.optimizer.param_groups[0]["lr"]
        report = self.trainer.train_step(iteration)
        if self.joined is not None:  # what this joiner's buckets sent to each commit
            self.joined["contributions"][iteration] = report.own_contributions
        self.pending.append((report, dict(lr=lr, tokens=report.contributions
                                          * cfg.micro_batch_size * cfg.model.seq_length)))
        if self.progress.is_writer():
            if self.log.path is None and cfg.recover.log:
                self.log = RecoverLog(cfg.recover.log)  # the writer moved here
            self.log.write_missing(self.pending)
            self.pending.clear()
        recovery_s = sum(e["committed"] - e["detected"] for e in report.events
                         if e["event"] == "failure")
        return StepResult(
            loss=report.loss, grad_norm=report.grad_norm, iteration_ms=report.iteration_ms,
            skipped=report.skipped, global_batch_size=report.B * cfg.micro_batch_size,
            events=report.events, exit_requested=report.exit_requested,
            aux_losses=moe_losses.iteration_values(cfg.model.moe, cfg.model.num_layers,
                                                   report.side_sums, report.contributions,
                                                   cfg.parallel.tensor_model_parallel_size),
            recover={"live replicas": report.live_replicas, "contributions": report.contributions,
                     "B": report.B, "recovery seconds": recovery_s,
                     **({"verified microbatches": report.verified}
                        if cfg.recover.sdc_check_rate > 0 else {}),
                     **({"non-finite reruns": sum(len(e["outcomes"]) for e in report.events
                                                  if e["event"] == "rerun")}
                        if cfg.recover.nonfinite_rerun != "off" else {}),
                     **({"microbatches per replica": ",".join(
                         f"{r}:{n}" for r, n in sorted(report.quotas.items())),
                         "slow replicas": len(report.slow)}
                        if cfg.recover.straggler_threshold or cfg.recover.evict_slower_than
                        else {})})

    def save(self, iteration: int) -> None:
        """torch_dist: every live rank saves, replicated tensors spread over the live replicas
        (`RankSetup.checkpoint_writers`); the torch format, and torch_dist when a standby
        joined, the lowest live replica alone (every rank agrees on it through the policy). A
        failure during the save leaves that checkpoint incomplete and the run going on."""
        trainer, setup = self.trainer, self.setup
        trainer.gather_parameters()
        lowest = min(trainer.p.policy.layout.replicas)
        state = capture(trainer, iteration)

        def written():  # this rank's part is on disk; the tracker has not moved
            if setup.local_rank == 0 and trainer.p.replica == lowest:
                checkpoint.write_summary(
                    loading.iteration_dir(self.cfg.checkpoint.save, iteration), state)
            trainer.p.faults.at("checkpoint-save", iteration)  # the failure schedule's point

        common = checkpoint_common.megatron_common(self.cfg, iteration, setup.padded_vocab_size)
        if self.cfg.checkpoint.ckpt_format == "torch":
            if trainer.p.replica == lowest:
                checkpoint.save(self.cfg.checkpoint.save, state, setup.chunks,
                                setup.optimizer, setup.scheduler, setup.checkpoint_position,
                                self.cfg.parallel.pipeline_model_parallel_size, common,
                                setup.control_group, setup.local_rank, written)
            return
        self._surviving(iteration, lambda: self._save_torch_dist(iteration, lowest, state,
                                                                 common, written))

    def _save_torch_dist(self, iteration: int, lowest: int, state, common: dict,
                         written) -> None:
        setup = self.setup
        writers = setup.checkpoint_writers(self.trainer.p.replica, lowest)
        if writers is None:
            if self.saves is not None:  # this replica's save, if any, is superseded
                self.saves.abandon()
            return
        dist_checkpoint.save(self.cfg.checkpoint.save, iteration, setup.chunks,
                             setup.optimizer, setup.scheduler, common, state.state_dict(), writers,
                             written, self.saves)

    def _poll(self, blocking: bool = False) -> None:
        """Complete an --async-save in flight once its writers all ended."""
        if self.saves is not None and self.saves.in_flight is not None:
            self._surviving(None, lambda: self.saves.poll(blocking))

    def _surviving(self, iteration: int | None, action) -> None:
        """Run a torch_dist save's `action`. When every live rank saves, a failure of one of
        them during it leaves the checkpoint incomplete (the tracker on the previous one) and
        the run going on to the next iteration, where it is recovered as any other: the
        survivors agree on it in a consensus over `saving_group`, which also repairs that
        group for the next save."""
        from megatron.core.dist_checkpointing.core import CheckpointingException
        from torch.distributed.checkpoint import CheckpointException  # a BaseException

        spreads = self.setup.spreads_saves()
        try:
            action()
        except (RuntimeError, CheckpointException, CheckpointingException) as error:
            if not spreads or not self.setup.saving_group.consensus().wait().has_failure:
                raise
            if self.saves is not None:
                self.saves.abandon()
            which = f"of iteration {iteration}" if iteration else "in flight"
            reason = (str(error) or type(error).__name__).splitlines()[0]
            if self.setup.saving_group.rank == 0:  # the lowest live rank, after the consensus
                print(f"megatron-recover: the checkpoint {which} is not complete: a rank failed "
                      f"during the save ({reason}); the tracker names the previous one",
                      flush=True)

    def committed(self, iteration: int) -> None:
        """An --async-save completes once its writers all ended; a node snapshot when one is
        due."""
        trainer, setup = self.trainer, self.setup
        self._poll()
        if self.snapshots is None or not self.snapshots.due(iteration,
                                                            trainer.p.policy.layout.replicas):
            return
        trainer.gather_parameters()
        self.snapshots.take(iteration, {
            **training_state.capture(setup.chunks, setup.optimizer, setup.scheduler),
            "protocol": capture(trainer, iteration).state_dict()})

    def exit_agreed(self, result: StepResult) -> bool:
        return result.exit_requested  # agreed in the step's commit lane

    def between(self, iteration: int) -> None:
        if self.grow_back is not None:
            self.grow_back(iteration)

    def finish(self) -> None:
        self._poll(blocking=True)
        if self.snapshots is not None:
            self.snapshots.finish()
        self.trainer.gather_parameters()  # the final parameters, on every shard

    def snapshot_seconds(self) -> dict | None:
        """A snapshot writer's seconds per copy and per write."""
        if self.snapshots is None:
            return None
        return {"copy_s": self.snapshots.copy_s, "write_s": self.snapshots.write_s}


def gather_parameters(chunks) -> None:
    """With --overlap-param-gather the last step's parameters reach the other shards only in the
    next forward; gather them now (in every model chunk), as Megatron-LM does before a save and
    at the end of training (its disable_forward_pre_hook)."""
    for chunk in chunks:
        if chunk.use_forward_hook:
            chunk.start_param_sync(force_sync=True)
