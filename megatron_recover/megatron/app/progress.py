"""After each iteration, what Megatron-LM's training loop does besides the step, in its order:
the iteration line and TensorBoard values, an evaluation when one is due, a checkpoint when
one is due, the exit checks; and the evaluations at the end of training (loop.py runs them for
both steppers).
"""

import os
import signal
import time
from typing import TYPE_CHECKING

import psutil
import torch.distributed as dist

from megatron_recover import runtime
from megatron_recover.megatron.adapters import groups
from megatron_recover.megatron.config import mcore_config
from megatron_recover.megatron.app.evaluation import EvalPass, result_of
from megatron_recover.megatron.app.report import IntervalStats, failure_lines
from megatron_recover.megatron.app.writers import (
    MetricWriters,
    moe_scalars,
    training_scalars,
    validation_scalars,
)

if TYPE_CHECKING:
    from megatron_recover.megatron.adapters.gpt import MicrobatchPass
    from megatron_recover.megatron.app.rank_setup import RankSetup
    from megatron_recover.recovery import ResilientTrainer


class ExitRequests:
    """Megatron-LM's --exit-duration-in-mins, --exit-interval and --exit-signal-handler."""

    def __init__(self, cfg):
        self.cfg = cfg.exit
        self.signal_received = False
        if self.cfg.signal_handler:
            signal.signal(getattr(signal, self.cfg.signal), self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        del signum, frame
        self.signal_received = True

    def minutes(self) -> float:
        """This rank's running time, from its process start (Megatron-LM: from pretrain's)."""
        return (time.time() - psutil.Process().create_time()) / 60

    def requested(self) -> bool:
        """Whether this rank asks to stop now (its clock, or the signal): the ranks agree on it."""
        duration = self.cfg.duration_mins
        return self.signal_received or (duration is not None and self.minutes() > duration)

    def reason(self, iteration: int, agreed_request: bool) -> str | None:
        """Why every rank stops after `iteration`, or None."""
        if agreed_request:
            if self.signal_received:
                return f"received {self.cfg.signal} (--exit-signal-handler)"
            if self.cfg.duration_mins is not None and self.minutes() > self.cfg.duration_mins:
                return (f"after {self.minutes():.2f} minutes (--exit-duration-in-mins "
                        f"{self.cfg.duration_mins:g})")
            return "another rank's --exit-duration-in-mins or --exit-signal-handler request"
        if self.cfg.interval and iteration % self.cfg.interval == 0:
            return f"--exit-interval {self.cfg.interval}"
        return None


class Progress:
    """What both training loops do after each iteration, in Megatron-LM's order: the iteration
    line and TensorBoard values, an evaluation when one is due, a checkpoint when one is due,
    and the exit checks; evaluations at the end of training. Every rank computes the same
    values; the lowest live rank prints and writes them."""

    def __init__(self, cfg, setup: "RankSetup", micro_pass: "MicrobatchPass", source,
                 vocab_size: int, exits: ExitRequests,
                 trainer: "ResilientTrainer | None" = None):
        """`trainer`: the resilient trainer (--recover), None for a stock run."""
        from megatron.core import parallel_state

        self.cfg = cfg
        self.setup = setup
        self.trainer = trainer
        self.stats = IntervalStats()
        self.exits = exits
        # Evaluation runs the training pass's schedule, with the failure schedule's points.
        self.eval_pass = EvalPass(setup.chunks, source, cfg.model.seq_length,
                                  cfg.micro_batch_size, micro_pass.faults,
                                  micro_pass.forward_backward, micro_pass.forward_step)
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        run_id = [f"megatron-recover-{int(time.time())}-{os.getpid()}"]
        if cfg.logging.wandb_project is not None:
            # The W&B run every writer resumes.
            dist.broadcast_object_list(run_id, src=0, group=groups.world_control())
        self.writers = MetricWriters(cfg, run_id[0])
        self.flops = (mcore_config.model_flops(cfg.model, mcore_config.padded_vocab_size(cfg, vocab_size), 1)
                      if cfg.logging.log_throughput else None)

    def is_writer(self) -> bool:
        """The lowest live rank: position 0 of the lowest live replica (global rank 0 when
        stock)."""
        if self.trainer is None:
            return dist.get_rank() == 0
        return self.setup.group.rank == 0 and self.setup.local_rank == 0

    def live_ranks(self) -> int:
        if self.trainer is None:
            return dist.get_world_size()
        return len(self.trainer.p.policy.layout.replicas) * self.cfg.parallel.ranks_per_replica

    def after_iteration(self, iteration: int, *, loss: float, skipped: bool, iteration_ms: float,
                        global_batch_size: int, grad_norm, recover: dict | None = None,
                        events=(), first: bool = False, aux_losses: dict | None = None) -> None:
        """The iteration line, the failure lines and the TensorBoard values. `first`: this
        launch's first iteration, whose line Megatron-LM prints whatever --log-interval says
        (to show the start-up overhead), without starting a new interval even when that
        iteration ends one (its training_log: `should_reset = not is_first_iteration`): the
        next line covers it again. `aux_losses`: the MoE router's
        auxiliary losses (moe_losses.py), on the line and, as Megatron-LM writes them, on
        TensorBoard at every iteration."""
        cfg, log = self.cfg, self.cfg.logging
        # A straggler's eviction is a replica lost as a failure is (fail-slow made fail-stop).
        evicted_slow = sum(len(e["evicted"]) for e in events if e["event"] == "straggler")
        lost = sum(len(e["replicas"]) for e in events if e["event"] == "failure") + evicted_slow
        self.stats.add(loss, skipped, iteration_ms, lost,
                       {name: value for name, (value, _) in (aux_losses or {}).items()})
        self.stats.evicted += sum(len(e["evicted"]) for e in events if e["event"] == "corruption")
        self.stats.evicted_nonfinite += sum(len(e["evicted"]) for e in events
                                            if e["event"] == "rerun")
        self.stats.evicted_slow += evicted_slow
        writer = self.is_writer()
        lr = self.setup.optimizer.param_groups[0]["lr"]  # after the step, as Megatron-LM logs
        consumed = cfg.global_batches.consumed_after(iteration)
        loss_scale = float(self.setup.optimizer.get_loss_scale())
        grad_norm = None if grad_norm is None else float(grad_norm)
        flops = None if self.flops is None else self.flops * global_batch_size
        if writer:
            runtime.write_progress(iteration)  # the launcher's stall watchdog reads it
            for line in failure_lines(iteration, list(events)):
                print(line, flush=True)
        if recover is not None:
            recover = {**recover, "failures": self.stats.failures}
            if "verified microbatches" in recover:
                recover["evicted for corruption"] = self.stats.evicted
            if "non-finite reruns" in recover:
                recover["evicted for non-finite"] = self.stats.evicted_nonfinite
            if "slow replicas" in recover:
                recover["evicted as stragglers"] = self.stats.evicted_slow
        ends_interval = iteration % log.log_interval == 0
        restart = ends_interval and not first
        if writer and (first or ends_interval):
            print(self.stats.line(iteration=iteration, train_iters=cfg.train_iters,
                                  consumed_samples=consumed, lr=lr,
                                  global_batch_size=global_batch_size, loss_scale=loss_scale,
                                  grad_norm=grad_norm, flops=flops, ranks=self.live_ranks(),
                                  recover=recover, restart=restart), flush=True)
        elif restart:
            self.stats.restart()  # the interval restarts on every rank: a new writer goes on
        if self.writers.enabled and aux_losses:
            self.writers.add(moe_scalars(cfg, iteration, aux_losses))
        if self.writers.enabled and iteration % log.tensorboard_log_interval == 0:
            seconds = iteration_ms / 1e3
            throughput = None if flops is None else flops / (seconds * 1e12 * self.live_ranks())
            self.writers.add(training_scalars(
                cfg, iteration=iteration, consumed_samples=consumed, lr=lr,
                global_batch_size=global_batch_size, loss=loss, loss_scale=loss_scale,
                grad_norm=grad_norm, iteration_s=seconds, throughput=throughput,
                live_ranks=self.live_ranks(), recover=recover))
        self.writers.write(writer)

    def evaluate(self, iteration: int, split: str = "valid", at_end: bool = False) -> None:
        """One evaluation of `split` after `iteration`; its line and TensorBoard values."""
        cfg = self.cfg
        interval = cfg.evaluation.interval
        if split == "valid":
            evaluation = (iteration // interval if not at_end else
                          (cfg.train_iters // interval if interval else 0) + 1)
        else:
            evaluation = 1
        chunks = self.setup.chunks
        hooked = chunks[0].use_forward_hook
        if hooked:
            # As Megatron-LM: no parameter all-gather overlaps an evaluation's forward passes.
            if self.trainer is not None:
                self.trainer.gather_parameters()
            for chunk in chunks:
                chunk.disable_forward_pre_hook(param_sync=self.trainer is None)
        try:
            if self.trainer is None:
                dp = cfg.data_parallel_size
                # Every rank runs as many (the count is eval_iters x B, B a multiple of dp), as
                # expert-parallel ranks must: they exchange tokens in every forward.
                ids = list(range(self.setup.dp_rank, self.eval_pass.count, dp))
                values = self.eval_pass.values(split, evaluation, iteration, ids,
                                               self.last_stage and self.tp_rank == 0)
                # each id's slot from exactly one rank
                dist.all_reduce(values, group=groups.world_control())
                events = []
            else:
                values, events = self.trainer.evaluate(
                    lambda ids, padding: self.eval_pass.values(
                        split, evaluation, iteration, ids, self.last_stage, padding),
                    self.eval_pass.count)
        finally:
            if hooked:
                for chunk in chunks:
                    chunk.enable_forward_pre_hook()
        result = result_of(values, split, evaluation, iteration)
        self.stats.failures += sum(len(e["replicas"]) for e in events)
        writer = self.is_writer()
        if writer:
            for line in failure_lines(iteration, events):
                print(line, flush=True)
            print(result.line(at_end), flush=True)
        if split == "valid":
            self.writers.add(validation_scalars(cfg, result,
                                                cfg.global_batches.consumed_after(iteration)))
        self.writers.write(writer)

    def save_due(self, iteration: int) -> bool:
        """As Megatron-LM: every --save-interval iterations, and once more at the end."""
        return self.cfg.checkpoint.due(iteration, self.cfg.train_iters)

    def stopping(self, iteration: int, agreed_request: bool, saved: bool, save) -> bool:
        """Whether every rank stops after `iteration` (an --exit-* flag); it saves first (once)
        with --save."""
        reason = self.exits.reason(iteration, agreed_request)
        if reason is None or iteration == self.cfg.train_iters:
            return False
        if self.cfg.checkpoint.save and not saved:
            save()
        if self.is_writer():
            save_dir = self.cfg.checkpoint.save
            saved_to = f"; checkpoint in {save_dir}" if save_dir else ""
            print(f"megatron-recover: exiting program at iteration {iteration}: {reason}"
                  f"{saved_to}", flush=True)
        return True

    def end_of_training(self, iteration: int) -> None:
        """Megatron-LM's evaluations after the last iteration: the validation and test splits."""
        if not self.cfg.evaluation.iters:
            return
        for split in self.eval_pass.splits():
            self.evaluate(iteration, split, at_end=True)
