"""The resilient training step: first pass, reduce, agree, restore or extend, commit, step.

One `ResilientTrainer.train_step(t)` per iteration, on every rank, drives the three layers:

  1. The policy says which microbatch ids this replica runs; `run_pass` runs them through
     megatron's schedule (pipeline flush and intra-replica syncs included), then every bucket's
     ulfm all-reduce is posted (layer 2 snapshots each bucket first; a spare zeroes its bucket
     after the snapshot). With --overlap-grad-reduce the first pass posts each bucket from the
     backward of its last microbatch, as megatron would, except the buckets megatron syncs
     inside the replica after backward (layer 2 posts those after the schedule); extension
     passes and blocking restores stay deferred.
  2. The commit lane — this replica's loss sum and the gradient ledger its buckets sent (which
     microbatch gradients they hold, with checksums of the batches; layer 2) — is all-reduced on
     the same group, then a consensus gives every survivor the same failure record. The census
     says whether each survivor's reductions all succeeded under the current epoch. The summed
     ledger is checked against the failure-free iteration (`audit.LedgerAudit`), not against
     the policy's plan.
  3. One verdict per replica: every intra-replica position (TP x PP rank) has its own
     cross-replica group, and the groups may learn of a dead replica in different rounds. The
     ranks of a replica exchange their records (an all-reduce on the intra-replica group): the
     dead replicas are the union, and the round commits only if no position saw a failure. Each
     position's record is agreed by all replicas, so every live replica reaches the same verdict;
     the invariant holds only if it holds at every position.
     A rank whose replica lost a member fails in this exchange and leaves (the replica gate).
  4. Otherwise the new dead replicas go to the policy: a promotion or a drop means a blocking
     restore (rewind every bucket, reduce again under the new membership); a boundary means a
     non-blocking one (empty the buckets, run the extension pass, add the snapshots back, reduce).
     Failures during any of this loop back to 2.
  5. Commit: the policy installs the next layout; the adaptive policy rescales the summed gradient
     to its committed count; the optimizer steps.

With --calculate-per-token-loss the schedule leaves each microbatch's loss a sum over its loss
tokens and megatron's own per-token division is skipped (`gpt._finalize_keeping_token_sums`); the
commit lane also sums the loss tokens of the microbatches in the sent ledger, and the committed
gradient is divided once by that count: all B microbatches' tokens under the static policy, the
committed microbatches' under drop-and-go.

With --overlap-param-gather (distributed-optimizer instances) megatron dispatches each bucket
group's parameter all-gather from the forward pre-hooks of the next pass, lazily, per pass. A
shard that runs no microbatch in a pass (an extension pass can give it none) would then never
join the all-gather its peers started. Here every shard dispatches all of them right after the
optimizer step, in the same order; the forward pre-hooks only wait for them, so the all-gather
still overlaps the next forward, and every shard waits for its own before the next step
(`gather_parameters()` before a checkpoint and at the end).

Every decision is a function of agreed records, so all survivors take the same branch.
"""

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megatron_recover.collective import ULFMGroup
from megatron_recover.megatron import hooks
from megatron_recover.megatron.audit import LedgerAudit
from megatron_recover.policy import ADAPTIVE, RESERVE, WorkloadPolicy
from megatron_recover.recovery import GradientRecovery, LaneLayout

LANE_HEAD = 3  # the commit lane: loss sum, loss tokens, exit request; then the ledger


@dataclass
class StepReport:
    """What one committed iteration did; one JSONL record of the recovery log."""

    iteration: int
    loss: float
    contributions: int  # microbatch gradients in the committed buckets (the ledger's count)
    B: int
    live_replicas: int
    epoch: int
    ledger_checksum: int  # sum of the committed batches' checksums (this position)
    invariant_ok: bool  # the committed ledger is the expected one, at every position
    ledger_problems: list[str]  # what this position's audit found (empty when it holds)
    grad_norm: float | None
    loss_scale: float  # the optimizer's loss scale after this step (1.0 without fp16 scaling)
    skipped: bool  # the fp16 loss scaler found inf/nan: no update, the lr scheduler kept still
    iteration_ms: float
    extension_rounds: int
    buckets: int
    events: list[dict] = field(default_factory=list)
    loss_tokens: int | None = None  # --calculate-per-token-loss: the committed loss tokens
    own_contributions: int = 0  # microbatch gradients this rank's buckets sent to the commit
    g_cur: int = 0  # the layout's microbatches per major replica when the iteration began
    exit_requested: bool = False  # some rank asked to stop after this iteration (--exit-*)
    # The first round's cross-replica reductions, from the ulfm worker's timestamps: how long
    # some reduction was running, how much of that before megatron's schedule returned (hidden
    # under backward), and this rank's snapshot and gradient-buffer bytes.
    reduction: dict = field(default_factory=dict)


@dataclass
class TrainerParts:
    """What the trainer drives. `run_pass(iteration, ids, losses, tokens)` runs forward/backward
    of `ids` through megatron's schedule (finalize included), adding each id's loss to `losses`
    and its loss-token count to `tokens` (on the last pipeline stage).
    `faults.at(location, iteration)` and `faults.arm_iteration(group, iteration, bucket)` are the
    failure simulator's points (a no-op object when there is no schedule)."""

    model: object  # megatron DistributedDataParallel
    replica_group: object | None  # the intra-replica (TP x PP) torch group; None: one rank
    computes_loss: bool  # False on pipeline stages before the last: they see no losses
    optimizer: object
    scheduler: object | None
    group: ULFMGroup
    policy: WorkloadPolicy
    replica: int
    replica_of_rank: dict[int, int]
    run_pass: Callable[[int, list[int], dict[int, float], dict[int, int]], None]
    faults: object
    audit: LedgerAudit
    restore: bool = True  # False: the --recover-no-restore negative control
    # Distributed-optimizer instances (HSDP): the replica's data-parallel ranks at this rank's
    # TP x PP position. They split the replica's microbatches and reduce-scatter its buckets.
    shard_group: object | None = None
    per_token_loss: bool = False  # --calculate-per-token-loss
    overlap_grad_reduce: bool = False  # --overlap-grad-reduce: post first-pass buckets in backward
    # Parameters megatron syncs in place inside the replica after backward (finalize_model_grads):
    # with overlap, their buckets are posted after the schedule.
    synced_inside_replica: frozenset = frozenset()
    # Whether this rank asks to stop after the iteration (--exit-duration-in-mins, a signal with
    # --exit-signal-handler); the request rides in the commit lane, so all survivors agree.
    wants_exit: Callable[[], bool] = lambda: False


class ResilientTrainer:
    def __init__(self, parts: TrainerParts, micro_batch_size: int):
        self.p = parts
        self.micro_batch_size = micro_batch_size
        self.dead_replicas: set[int] = set()
        # Events between iterations (a join), reported with the next committed iteration.
        self.pending_events: list[dict] = []
        # When this rank last saw every member complete a round (a commit): a victim's last
        # observed progress. A crash is detected soon after; a frozen rank about the hang timeout.
        self._last_progress = time.time()
        self._iteration = 0
        self._extended = False  # an extension pass ran in the iteration in progress
        self._schedule_end = 0.0  # when the first pass's schedule returned (reduction timing)
        config = parts.policy.config
        self.lane_layout = LaneLayout(config.b, reserve=config.mode == RESERVE
                                      and config.policy != ADAPTIVE)
        buckets = [bucket for group in parts.model.bucket_groups for bucket in group.buckets]
        deferred = [bucket.grad_data for bucket in buckets
                    if parts.overlap_grad_reduce and bucket.params & parts.synced_inside_replica]
        self.recovery = GradientRecovery(parts.group, [bucket.grad_data for bucket in buckets],
                                         before_first_reduce=self._before_reduce,
                                         after_first_post=self._after_post,
                                         shard_group=parts.shard_group, deferred=deferred)
        if parts.shard_group is None:
            self._shard, self._shards = 0, 1
        else:
            self._shard = dist.get_rank(parts.shard_group)
            self._shards = dist.get_world_size(parts.shard_group)
        hooks.install(parts.group.process_group, self.recovery)
        # Megatron's flag for a parameter all-gather dispatched by the optimizer step: the
        # forward pre-hooks then only wait, and do not dispatch the next bucket group's.
        self._overlap_param_gather = parts.model.use_forward_hook
        if self._overlap_param_gather:
            parts.model.overlap_param_gather_with_optimizer_step = True
            self._dispatch_param_gather()

    @property
    def shard(self) -> tuple[int, int]:
        """(this rank's shard, shards) of its replica's data-parallel ranks: (0, 1) without
        distributed-optimizer instances."""
        return self._shard, self._shards

    def _dispatch_param_gather(self) -> None:
        """Post every bucket group's parameter all-gather inside the instance (asynchronous)."""
        self.p.model.start_param_sync(force_dispatch=True)

    def gather_parameters(self) -> None:
        """Wait for this rank's parameter all-gathers: the model's parameters are then the ones
        the last step produced on every shard (nothing to do without --overlap-param-gather)."""
        if not self._overlap_param_gather:
            return
        for bucket_group in self.p.model.bucket_groups:
            if bucket_group.param_gather_handle is not None:
                bucket_group.param_gather_handle.wait()
                bucket_group.param_gather_handle = None

    def _before_reduce(self) -> None:
        self.p.faults.at("before-reduce", self._iteration)

    def _after_post(self) -> None:
        self.p.faults.at("after-post", self._iteration)

    def train_step(self, iteration: int) -> StepReport:
        p = self.p
        self._iteration = iteration
        start = time.perf_counter()
        events, self.pending_events = self.pending_events, []
        # Overlapped, the first bucket posted is in flight while backward still runs.
        p.faults.arm_iteration(p.group, iteration, bucket_index=1 if p.overlap_grad_reduce else 2)
        state = p.policy.begin(iteration)
        hooks.set_loss_divisor(state.b)  # B of this iteration (a ramp-up changes it)
        work = p.policy.work(p.replica)
        losses: dict[int, float] = {}
        tokens: dict[int, int] = {}
        # As Megatron-LM's train_step: the optimizer left param.grad aliasing the grad buffer;
        # without dropping it, backward would add each first microbatch's gradient twice.
        p.model.zero_grad_buffer()
        p.optimizer.zero_grad()
        self.recovery.begin_iteration()
        self._extended = False
        self.recovery.begin_pass()
        self.recovery.contributing = work.contributes_first_pass
        p.faults.at("pre-forward", iteration)
        self._run(iteration, self._mine(work.first_pass), losses, tokens,
                  overlap=p.overlap_grad_reduce)
        reduction = None

        while True:
            failed_locally = bool(self.recovery.wait())
            if reduction is None:
                reduction = self._reduction_timing(self._schedule_end)
            lane = self._lane(iteration, losses, tokens)
            lane_record = p.group.allreduce(lane).wait()
            ok = int(not failed_locally and not lane_record.has_failure
                     and self.recovery.all_reduced() and lane_record.epoch == p.group.epoch)
            agreed = p.group.consensus([ok]).wait()
            totals, problems = None, []
            if not agreed.failed_ranks and agreed.census[0] == agreed.size:
                # This position's round succeeded everywhere: its lane is the committed ledger.
                totals = self.lane_layout.decode(lane[LANE_HEAD:])
                # Only the last pipeline stage saw the loss tokens.
                counted = int(lane[1]) if p.per_token_loss and p.computes_loss else None
                problems = p.audit.problems(iteration, totals, self._divisor(), counted)
            verdict = self._replica_verdict(agreed, lane, bool(problems))
            dead, commit = verdict.dead, verdict.commit
            if commit:
                self._last_progress = time.time()
                break
            detected = time.time()
            new_dead = sorted(dead - self.dead_replicas)
            if new_dead:
                self.dead_replicas.update(new_dead)
                decision = p.policy.on_failure(new_dead)
                work = p.policy.work(p.replica)
                events.append({"event": "failure", "replicas": new_dead,
                               "ranks": list(agreed.failed_ranks), "epoch": agreed.epoch,
                               "detected": detected, "repaired": detected,
                               "since_last_progress_s": detected - self._last_progress,
                               "restore": decision.restore_mode, "g_ext": decision.g_ext,
                               "promotions": [list(x) for x in decision.promotions]})
                if decision.boundary:
                    self._extension_pass(iteration, work, losses, tokens)
                    events[-1]["restored"] = time.time()
                    continue
            else:
                events.append({"event": "retry", "epoch": agreed.epoch, "detected": detected})
            self._blocking_restore(iteration, work)
            events[-1]["restored"] = time.time()

        p.audit.committed(totals)
        report = self._commit(iteration, totals, problems, verdict, agreed, start, events)
        report.reduction = reduction
        report.g_cur = state.layout.g_cur
        return report

    def grow(self, joined: dict[int, int], lost_ranks: list[int],
             dead_replicas: set[int] = frozenset()) -> dict | None:
        """Between iterations: the ranks `joined` (world rank -> replica id, on this rank's
        group already) took dead replicas' ids, and the group lost `lost_ranks` (agreed) while
        they joined, and the replicas `dead_replicas` lost a rank at another position; the
        policy lays out the grown set without the replicas lost. Returns the failure event of
        those, if any."""
        self.p.policy.grow(set(joined.values()))
        self.p.replica_of_rank.update(joined)
        self.dead_replicas -= set(joined.values())
        ranks = [r for r in lost_ranks if r not in joined and r in self.p.replica_of_rank]
        dead = sorted(({self.p.replica_of_rank[r] for r in ranks} | set(dead_replicas))
                      - self.dead_replicas)
        if not dead:
            return None
        self.dead_replicas.update(dead)
        self.p.policy.drop(dead)
        return {"event": "failure", "replicas": dead, "ranks": ranks,
                "epoch": self.p.group.epoch, "detected": time.time(), "during": "join"}

    def evaluate(self, run_ids: Callable[[list[int]], torch.Tensor],
                 count: int) -> tuple[torch.Tensor, list[dict]]:
        """An evaluation between iterations: the live replicas split the ids 0..count-1
        (replica i of W runs i, i + W, ...; a replica's shards every S-th of those), and
        `run_ids(ids)` returns this rank's slot vector (evaluation.py). The vectors are summed
        over the replicas' ulfm group; a failure anywhere makes every survivor drop the dead
        replicas from the policy's layout (as an iteration boundary would) and evaluate again
        on the new split. Returns the summed vector, on every rank of every live replica, and
        the failure events."""
        p = self.p
        events = []
        while True:
            live = sorted(p.policy.layout.replicas)
            values = run_ids(self._mine(range(live.index(p.replica), count, len(live))))
            if p.shard_group is not None:
                dist.all_reduce(values, group=p.shard_group)  # the shards split the replica's
            record = p.group.allreduce(values).wait()
            ok = int(not record.has_failure and record.epoch == p.group.epoch)
            agreed = p.group.consensus([ok]).wait()
            verdict = self._replica_verdict(agreed, torch.zeros(LANE_HEAD), ledger_bad=False)
            if verdict.commit:
                self._last_progress = time.time()
                break
            new_dead = sorted(verdict.dead - self.dead_replicas)
            if new_dead:
                self.dead_replicas.update(new_dead)
                p.policy.drop(new_dead)
                events.append({"event": "failure", "replicas": new_dead,
                               "ranks": list(agreed.failed_ranks), "epoch": agreed.epoch,
                               "detected": time.time(), "during": "evaluation"})
        if p.replica_group is not None:
            # Only the last pipeline stage ran the loss: the others hold zeros.
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=p.replica_group)
        return values, events

    def _reduction_timing(self, schedule_end: float) -> dict:
        """The first round's reductions: the time some reduction was running, and the part of
        it before `schedule_end` (megatron's schedule had not returned: hidden under backward
        with --overlap-grad-reduce), in ms; snapshot and gradient-buffer bytes."""
        busy = hidden = 0.0
        reach = float("-inf")
        for start, end in sorted(self.recovery.intervals):  # the union of the intervals
            start = max(start, reach)
            if end > start:
                busy += end - start
                hidden += max(0.0, min(end, schedule_end) - start)
                reach = end
        grads = self.recovery.grads
        return {"reduce_ms": busy * 1e3, "hidden_ms": hidden * 1e3,
                "snapshot_bytes": self.recovery.snapshot_bytes,
                "grad_bytes": sum(g.numel() * g.element_size() for g in grads)}

    def _mine(self, ids) -> list[int]:
        """The ids of the replica's `ids` this rank runs: all, or every S-th with S shards."""
        return list(ids)[self._shard::self._shards]

    def _divisor(self) -> int:
        """What the iteration's loss and gradient are divided by if it commits now."""
        state = self.p.policy.state
        return state.contributions() if state.config.policy == ADAPTIVE else state.b

    def _lane(self, iteration: int, losses: dict[int, float],
              tokens: dict[int, int]) -> torch.Tensor:
        """[loss sum, loss tokens, exit request, ledger] of what this rank's buckets sent to
        their reductions;
        with distributed-optimizer shards, summed over the replica's shards (the union of their
        ledgers, as the reduce-scatter summed their gradients).

        The sums are over the ids in the sent ledger, so the logged loss is the loss of the
        gradients that were reduced (each id's loss is on the last pipeline stage that ran it),
        and the token count is that of the microbatches the committed gradient holds.
        """
        sent, consistent = self.recovery.sent_ledger()
        self._own_contributions = 0 if sent is None else sum(sent.entries.values())
        loss_sum, token_sum = 0.0, 0
        if sent is not None and self.p.computes_loss:
            loss_sum = sum(n * losses.get(k, float("nan")) for (_, k, _), n in sent.entries.items())
            token_sum = sum(n * tokens.get(k, 0) for (_, k, _), n in sent.entries.items())
        head = [loss_sum, token_sum, float(self.p.wants_exit())]
        lane = torch.cat([torch.tensor(head, dtype=torch.float64),
                          self.lane_layout.encode(sent, iteration, poison=int(not consistent))])
        if self.p.shard_group is not None:
            dist.all_reduce(lane, group=self.p.shard_group)  # intra-replica, as the reduce-scatter
        return lane

    def _replica_verdict(self, agreed, lane, ledger_bad: bool) -> "_Verdict":
        """The round's outcome for this replica, equal on all of its ranks.

        Without pipeline stages every position holds the loss; with them only the last stage
        does, and the others report 0, so the maximum is the replica's loss sum (and token count).
        """
        p = self.p
        w_init = p.policy.config.w_init
        verdict = torch.zeros(w_init + 5, dtype=torch.float64)
        for rank in agreed.failed_ranks:
            verdict[p.replica_of_rank[rank]] = 1.0
        verdict[w_init] = float(bool(agreed.failed_ranks) or agreed.census[0] != agreed.size)
        verdict[w_init + 1] = lane[0]
        verdict[w_init + 2] = float(ledger_bad)
        verdict[w_init + 3] = lane[1]
        verdict[w_init + 4] = lane[2]
        if p.replica_group is not None:
            # A peer that died makes this raise; the exit hook then takes this rank down too.
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=p.replica_group)
        return _Verdict(dead={r for r in range(w_init) if verdict[r] > 0},
                        commit=bool(verdict[w_init] == 0), loss_sum=float(verdict[w_init + 1]),
                        tokens=int(verdict[w_init + 3]),
                        invariant_ok=bool(verdict[w_init + 2] == 0),
                        exit_requested=bool(verdict[w_init + 4] > 0))

    def _run(self, iteration: int, ids: list[int], losses: dict[int, float],
             tokens: dict[int, int], overlap: bool = False) -> None:
        """Run `ids` (possibly none: every rank still joins the reductions) through the schedule,
        then post every bucket's reduction not posted during its backward (`overlap`)."""
        if ids:
            if overlap:
                self.recovery.start_overlap()
            try:
                self.p.run_pass(iteration, ids, losses, tokens)
            finally:
                self.recovery.stop_overlap()
        self._schedule_end = time.time()  # what reduce_all posts now was not under backward
        self.recovery.reduce_all()

    def _blocking_restore(self, iteration: int, work) -> None:
        """Rewind every bucket and reduce it again under the new membership and roles.

        The snapshot holds what the replica's latest reduction started from: its first pass
        (which an unpromoted spare keeps out of the reduce) or, after an extension pass, exactly
        the ids it contributes (extension ids, plus its earlier contributions added back).
        """
        self.p.faults.at("during-restore", iteration)
        self.recovery.begin_pass()
        if self.p.restore:
            self.recovery.rewind()
        self.recovery.contributing = work.contributes_first_pass or self._extended
        self.recovery.reduce_all()

    def _extension_pass(self, iteration: int, work, losses: dict[int, float],
                        tokens: dict[int, int]) -> None:
        """Run the extension ids on empty buckets (so the schedule's intra-replica syncs see only
        the new gradients), then add back what this replica already counts, then reduce."""
        self.recovery.begin_pass()
        self._extended = True
        extension = work.extension
        counted_before = len(work.contributed) - len(extension)
        if self.p.restore:
            self.recovery.zero()
        self.recovery.contributing = True
        self.p.faults.at("during-extension", iteration)
        # A shard may get none of its instance's extension ids: megatron's schedule cannot run
        # zero microbatches, and the shard has nothing to add but still joins the reductions.
        mine = self._mine(extension)
        if mine:
            if self.p.overlap_grad_reduce:
                # Megatron counts each parameter's gradient-ready hooks per pass to know when a
                # bucket is complete; start this pass's count from zero (posting stays ours).
                for bucket_group in self.p.model.bucket_groups:
                    bucket_group.reset()
            self.p.run_pass(iteration, mine, losses, tokens)
        if self.p.restore and counted_before > 0:
            self.recovery.add_snapshots()
        self.recovery.reduce_all()

    def _commit(self, iteration, totals, problems, verdict: "_Verdict", agreed, start,
                events) -> StepReport:
        p = self.p
        b = p.policy.state.b
        result = p.policy.commit()
        divisor = result.divisor
        if p.per_token_loss:
            # The buckets hold sums over tokens; divide once by the committed ones, as
            # megatron-core's finalize_model_grads does (nothing when every token was masked).
            divisor = verdict.tokens
            if divisor > 0:
                p.model.scale_gradients(1.0 / divisor)
        elif result.divisor != b:
            # Losses were divided by B in the schedule; drop-and-go divides by what it committed.
            p.model.scale_gradients(b / result.divisor)
        p.faults.at("optimizer-step", iteration)
        self.gather_parameters()  # the step writes this shard into the gathered buffers
        # Every survivor holds the same reduced gradient, so the loss scaler's found-inf decision
        # (taken on the intra-replica group) and its new scale are the same on all of them.
        update_successful, grad_norm, _ = p.optimizer.step()
        if update_successful and p.scheduler is not None:
            # As Megatron-LM: a skipped step consumed its samples but does not move the lr.
            p.scheduler.step(increment=b * self.micro_batch_size)  # this iteration's batch
        if self._overlap_param_gather:
            self._dispatch_param_gather()  # waited for by the next forward's pre-hooks
        for event in events:
            event["committed"] = time.time()
        return StepReport(
            iteration=iteration, loss=verdict.loss_sum / max(divisor, 1),
            contributions=totals.count, B=b,
            live_replicas=len(result.roles), epoch=agreed.epoch,
            ledger_checksum=totals.checksum, invariant_ok=verdict.invariant_ok,
            ledger_problems=problems,
            grad_norm=None if grad_norm is None else float(grad_norm),
            loss_scale=float(p.optimizer.get_loss_scale()), skipped=not update_successful,
            iteration_ms=(time.perf_counter() - start) * 1e3,
            extension_rounds=len(result.extension_rounds),
            buckets=len(self.recovery.grads), events=events,
            loss_tokens=verdict.tokens if p.per_token_loss else None,
            own_contributions=self._own_contributions,
            exit_requested=verdict.exit_requested)


@dataclass
class _Verdict:
    """A round's outcome for one replica: the same on all of its ranks."""

    dead: set[int]  # replicas any position saw fail
    commit: bool  # no position saw a failure: the round commits
    loss_sum: float  # the replica's loss sum (the last pipeline stage's)
    tokens: int  # the loss tokens of the microbatches in the committed ledger
    invariant_ok: bool  # the ledger invariant held at every position
    exit_requested: bool = False  # some rank of some replica asked to stop after this iteration
