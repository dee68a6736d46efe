"""The round core: one iteration's exactness argument, and nothing else.

`Round.step(t)` runs on every rank of every live replica:

  1. First pass. The policy says which microbatch ids this replica runs; the pass runner runs
     them (pipeline flush and intra-replica syncs included), then every bucket's ulfm all-reduce
     is posted (layer 2 snapshots each bucket first; a spare zeroes its bucket after the
     snapshot). With --overlap-grad-reduce the first pass posts each bucket from the backward of
     its last microbatch, as megatron would, except the buckets synced inside the replica after
     backward (posted after the pass); extension passes and blocking restores stay deferred.
  2. Wait and lane. The commit lane (`lane.CommitLane`) — this replica's loss sum, the gradient
     ledger its buckets sent (which microbatch gradients they hold, with checksums of the
     batches), and each registered check's segment — is all-reduced on the same group.
  3. Consensus. Every survivor gets the same failure record; the census says whether each
     survivor's reductions all succeeded under the current epoch.
  4. Verdict. Every intra-replica position (TP x PP rank) has its own cross-replica group, and
     the groups may learn of a dead replica in different rounds: the ranks of a replica combine
     their views on the replica's control group (`lane.VerdictCodec`). The dead replicas are the
     union; the round commits only if no position saw a failure and no check holds it. A rank
     whose replica lost a member fails in this exchange and leaves (the replica gate).
  5. Restore or extend. New dead replicas go to the policy: a promotion or a drop means a
     blocking restore (rewind every bucket, reduce again under the new membership); a boundary
     means a non-blocking one (rewind the buckets, on CUDA on a side stream under the extension
     pass's first forward, run the pass on top, reduce). A check that holds the round acts first
     (`checks.base`): it evicts replicas (handled as failures) or asks for the same contributions
     to be reduced again. Failures during any of this loop back to 2.
  6. Commit. The policy installs the next layout; the adaptive policy rescales the summed
     gradient to its committed count; the optimizer steps.

Every decision is a function of agreed records, so all survivors take the same branch. The
logged loss is the committed lane's loss sum over its tokens, as Megatron-LM logs it; with
per-token loss the pass runner leaves each microbatch's gradient a sum over its loss tokens, and
the committed gradient is divided once by the committed token count.

With shards in step (expert parallelism inside a replica: the shards exchange tokens in every
forward) every shard runs passes of one length, the shorter shares padded (`share`). With
overlapped parameter gathers every shard dispatches all of them right after the optimizer step,
in the same order, so a shard that runs no microbatch in a pass still joins its peers'.
"""

from __future__ import annotations

import time

import torch

from megatron_recover.policy import ADAPTIVE, RESERVE
from megatron_recover.recovery.checks.base import HOLD, Check
from megatron_recover.recovery.gradients import GradientRecovery, PassMode
from megatron_recover.recovery.lane import CommitLane, LaneHead, Verdict, VerdictCodec
from megatron_recover.recovery.ledger import LaneLayout
from megatron_recover.recovery.report import StepReport


def share(ids, shard: int, shards: int, in_step: bool) -> tuple[list[int], int]:
    """The ids of a replica's `ids` that its shard `shard` of `shards` runs (every S-th), and
    the padding microbatches it appends: with shards in step, up to the longest share."""
    ids = list(ids)
    mine = ids[shard::shards]
    if not in_step:
        return mine, 0
    return mine, -(-len(ids) // shards) - len(mine)


class PassTimer:
    """A pass's elapsed time where it runs, from construction to the latest `stop`. On CUDA the
    host returns from megatron's schedule before the kernels it queued finish, so events on the
    current stream time the device's work, and `seconds` waits for the end event (read after
    the pass's reductions, which consumed its gradients: nothing is left to wait for). On a
    machine without CUDA, the host clock."""

    def __init__(self):
        self._cuda = torch.cuda.is_available()
        self._start = self._mark()
        self._end = None

    def _mark(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self) -> None:
        self._end = self._mark()

    def seconds(self) -> float:
        if not self._cuda:
            return self._end - self._start
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


class Round:
    """The round protocol of one rank over `parts` (`trainer.TrainerParts`) and the registered
    `checks`, in their order of precedence."""

    def __init__(self, parts, checks: list[Check]):
        self.p = parts
        self.checks = checks
        self.dead_replicas: set[int] = set(parts.dead_replicas)
        # Events between iterations (a join), reported with the next committed iteration.
        self.pending_events: list[dict] = []
        # When this rank last saw every member complete a round (a commit): a victim's last
        # observed progress. A crash is detected soon after; a frozen rank about the hang timeout.
        self.last_progress = time.time()
        self.iteration = 0
        self.extended = False  # an extension pass ran in the iteration in progress
        self._schedule_end = 0.0  # when the first pass's schedule returned (reduction timing)
        self._own_contributions = 0
        self.first_pass: tuple[PassTimer, int] | None = None  # its timer and microbatches
        config = parts.policy.config
        reserve = config.mode == RESERVE and config.policy != ADAPTIVE
        self.lane = CommitLane(LaneLayout(config.b, reserve=reserve),
                               [(c.name, c.lane_size) for c in checks if c.lane_size])
        self.verdicts = VerdictCodec(config.w_init,
                                     [(c.name, c.verdict_size) for c in checks if c.verdict_size])
        self.recovery = GradientRecovery(parts.group, parts.buffers.buckets(),
                                         before_first_reduce=self._before_reduce,
                                         after_first_post=self._after_post,
                                         shard_group=parts.shard_group,
                                         shard_groups=parts.bucket_shard_groups,
                                         deferred=parts.buffers.deferred(),
                                         synced=parts.buffers.synced(),
                                         chunk_buckets=parts.buffers.chunk_buckets(),
                                         check_finite=parts.check_finite,
                                         restore_stream=(torch.cuda.Stream(
                                             device=parts.buffers.buckets()[0].device)
                                             if torch.cuda.is_available() else None))
        control = parts.shard_control
        self.shard, self.shards = (0, 1) if control is None else (control.rank, control.size)

    # -- the round ----------------------------------------------------------------------------

    def step(self, iteration: int) -> StepReport:
        p = self.p
        self.iteration = iteration
        start = time.perf_counter()
        events, self.pending_events = self.pending_events, []
        # Overlapped, the first bucket posted is in flight while backward still runs.
        p.faults.arm_iteration(p.group, iteration, bucket_index=1 if p.overlap_grad_reduce else 2)
        state = p.policy.begin(iteration)
        work = p.policy.work(p.replica)
        losses: dict[int, float] = {}
        tokens: dict[int, int] = {}
        # As Megatron-LM's train_step: without dropping the grads the optimizer left aliasing
        # the buffers, backward would add each first microbatch's gradient twice.
        p.buffers.zero()
        p.optimizer.zero_grad()
        self.recovery.begin_iteration()
        self.extended = False
        for check in self.checks:
            check.begin(self, iteration)
        self.recovery.begin_pass(self._mode(work.contributes_first_pass, first=True))
        p.faults.at("pre-forward", iteration)
        self._run(iteration, *self.share(work.first_pass), losses, tokens,
                  overlap=p.overlap_grad_reduce, first=True)
        for check in self.checks:
            check.first_pass_done(self)
        reduction = None

        while True:
            failed_locally = bool(self.recovery.wait())
            if reduction is None:
                reduction = self._reduction_timing(self._schedule_end)
            agreed, verdict, totals = self._agree(iteration, losses, tokens, failed_locally)
            holding = self._holding(verdict)
            if verdict.commit and holding is None:
                self.last_progress = time.time()
                break
            work = self._recover(iteration, work, agreed, verdict, holding, events, losses,
                                 tokens)

        report = self._commit(iteration, totals, verdict, agreed, start, events)
        report.reduction = reduction
        report.committed_s = self.last_progress
        report.g_cur = state.layout.g_cur
        report.quotas = {r: len(w.first_pass) for r, w in state.work.items()
                         if w.contributes_first_pass}
        return report

    def _agree(self, iteration: int, losses: dict[int, float], tokens: dict[int, int],
               failed_locally: bool):
        """Steps 2 to 4: sum the commit lane, agree on the failure record, and combine the
        positions' views into the replica's verdict. Returns (the agreed record, the verdict,
        the committed ledger's totals at this position: None when its round failed)."""
        p = self.p
        lane = self._lane(iteration, losses, tokens)
        lane_record = p.group.allreduce(lane).wait()
        ok = int(not failed_locally and not lane_record.has_failure
                 and self.recovery.all_reduced() and lane_record.epoch == p.group.epoch)
        agreed = p.group.consensus([ok]).wait()
        round_ok = not agreed.failed_ranks and agreed.census[0] == agreed.size
        head, totals, views = self.lane.decode_head(lane), None, {}
        if round_ok:  # this position's round succeeded everywhere: the committed ledger
            totals = self.lane.decode_ledger(lane)
            summed = self.lane.decode_parts(lane)
            views = {c.name: c.view(self, iteration, summed.get(c.name), totals, head)
                     for c in self.checks}
        verdict = self.verdict(agreed, head, not round_ok, views)
        return agreed, verdict, totals

    def _recover(self, iteration: int, work, agreed, verdict: Verdict, holding: Check | None,
                 events: list[dict], losses: dict[int, float], tokens: dict[int, int]):
        """Step 5, for a round that did not commit: the holding check acts (when no replica
        failed) or the checks hear of the failure; new dead replicas go to the policy, then a
        blocking restore or an extension pass posts the reductions of the next round. Returns
        this replica's work for it."""
        p = self.p
        detected = time.time()
        cause = None
        if verdict.commit:  # no failure, but a check holds the round
            new_dead = holding.act(self, iteration, verdict.parts.get(holding.name),
                                   events, detected)
            ranks = self.ranks_of(new_dead)
            cause = holding.cause
            if not new_dead:  # nothing to evict: reduce the same contributions again
                self._blocking_restore(iteration, work)
                events[-1]["restored"] = time.time()
                return work
        else:
            new_dead = sorted(verdict.dead - self.dead_replicas)
            ranks = list(agreed.failed_ranks)
            for check in self.checks:
                new_dead = check.on_failure(self, iteration, new_dead)
        if new_dead:
            self.dead_replicas.update(new_dead)
            decision = p.policy.on_failure(new_dead)
            work = p.policy.work(p.replica)
            events.append({"event": "failure", "replicas": new_dead,
                           "ranks": ranks, "epoch": agreed.epoch,
                           "detected": detected, "repaired": detected,
                           "since_last_progress_s": detected - self.last_progress,
                           "restore": decision.restore_mode, "g_ext": decision.g_ext,
                           "promotions": [list(x) for x in decision.promotions]})
            if cause is not None:
                events[-1]["cause"] = cause
            if decision.boundary:
                self._extension_pass(iteration, work, losses, tokens)
                events[-1]["restored"] = time.time()
                return work
        else:
            events.append({"event": "retry", "epoch": agreed.epoch, "detected": detected})
        self._blocking_restore(iteration, work)
        events[-1]["restored"] = time.time()
        return work

    def _holding(self, verdict: Verdict) -> Check | None:
        """The check that acts on a committable round: the first registered that holds it."""
        return next((c for c in self.checks if c.asks(self, verdict.parts.get(c.name)) == HOLD),
                    None)

    def verdict(self, agreed, summed: LaneHead, failed: bool,
                views: dict | None = None) -> Verdict:
        """The round's outcome for this replica, equal on all of its ranks: this position's
        view (the `agreed` record, the summed lane's head, whether its round failed, its checks'
        verdict segments), combined with the replica's other positions."""
        p = self.p
        dead = {p.replica_of_rank[rank] for rank in agreed.failed_ranks}
        vector = self.verdicts.encode(dead, failed, summed, views)
        if p.replica_control is not None:
            # A peer that died makes this raise; the rank then leaves with its replica.
            p.replica_control.max(vector)
        return self.verdicts.decode(vector)

    def _lane(self, iteration: int, losses: dict[int, float],
              tokens: dict[int, int]) -> torch.Tensor:
        """This rank's commit lane: the loss sum and loss tokens of the ids in its sent ledger
        (so the logged loss is the loss of the gradients that were reduced; each id's loss is on
        the last pipeline stage that ran it), its exit request, the ledger, and the checks'
        segments; with distributed-optimizer shards, summed over the replica's shards (the union
        of their ledgers, as the reduce-scatter summed their gradients)."""
        sent, consistent = self.recovery.sent_ledger()
        self._own_contributions = 0 if sent is None else sum(sent.entries.values())
        loss_sum, token_sum = 0.0, 0
        if sent is not None and self.p.computes_loss:
            loss_sum = sum(n * losses.get(k, float("nan")) for (_, k, _), n in sent.entries.items())
            token_sum = sum(n * tokens.get(k, 0) for (_, k, _), n in sent.entries.items())
        head = LaneHead(loss_sum, token_sum, self.p.wants_exit())
        parts = {c.name: c.lane(self, iteration, sent) for c in self.checks if c.lane_size}
        lane = self.lane.encode(head, sent, iteration, poison=int(not consistent), parts=parts)
        if self.p.shard_control is not None:
            self.p.shard_control.sum(lane)  # intra-replica, as the reduce-scatter
        return lane

    # -- passes, restores, the commit ---------------------------------------------------------

    def _before_reduce(self) -> None:
        self.p.faults.at("before-reduce", self.iteration)
        self.p.faults.corrupt(self.iteration, self.recovery.grads[0])

    def _after_post(self) -> None:
        self.p.faults.at("after-post", self.iteration)

    def _mode(self, contributing: bool, first: bool) -> PassMode:
        """The mode of a round of reductions: whether this replica contributes, and what the
        checks ask of it (`Check.pass_mode`; `first`: the iteration's first pass)."""
        fields = {}
        for check in self.checks:
            fields.update(check.pass_mode(self, first))
        return PassMode(contributing=contributing, **fields)

    def run_pass(self, iteration: int, ids: list[int], losses: dict[int, float],
                 tokens: dict[int, int], padding: int = 0) -> PassTimer:
        """The pass runner on `ids` and `padding` (and a slowdown the failure schedule asks
        for), timed."""
        timer = PassTimer()
        self.p.run_pass(iteration, ids, self.p.policy.state.b, losses, tokens, padding,
                        self.recovery)
        timer.stop()
        self.p.faults.slow_down(iteration, len(ids), timer.seconds)
        timer.stop()  # the slowdown is part of the pass
        return timer

    def run_for(self, iteration: int, ids: list[int]) -> None:
        """Run a replica's `ids` (this rank's share of them) on empty buckets, for a check; the
        buckets then hold that gradient (the caller empties, rewinds or keeps them). Losses are
        not reported: the replica whose ids they are reports its own."""
        self.recovery.zero()
        mine, padding = self.share(ids)
        if mine or padding:
            self.p.buffers.new_pass()
            self.run_pass(iteration, mine, {}, {}, padding)

    def _run(self, iteration: int, ids: list[int], padding: int, losses: dict[int, float],
             tokens: dict[int, int], overlap: bool = False, first: bool = False) -> None:
        """Run `ids` (possibly none: every rank still joins the reductions) through the pass
        runner, then post every bucket's reduction not posted during its backward (`overlap`).
        The first pass's timer and microbatches stay for the checks (`first`): the replica's
        compute, without any wait on other replicas (none happens inside a pass)."""
        if first:
            self.first_pass = None
        if ids or padding:
            if overlap:
                self.recovery.start_overlap()
            try:
                timer = self.run_pass(iteration, ids, losses, tokens, padding)
            finally:
                self.recovery.stop_overlap()
            if first and ids:  # per microbatch run, padding included (it costs the same)
                self.first_pass = (timer, len(ids) + padding)
        self._schedule_end = time.time()  # what reduce_all posts now was not under backward
        self.recovery.reduce_all()

    def _blocking_restore(self, iteration: int, work) -> None:
        """Rewind every bucket and reduce it again under the new membership and roles.

        The snapshot holds what the replica's latest reduction started from: its first pass
        (which an unpromoted spare keeps out of the reduce) or, after an extension pass, exactly
        the ids it contributes (extension ids, plus its earlier contributions added back).
        A check may hold this replica's contribution out (a non-finite suspect keeps its rerun
        in the buckets).
        """
        self.p.faults.at("during-restore", iteration)
        held = any(check.holds_own(self) for check in self.checks)
        contributing = (work.contributes_first_pass or self.extended) and not held
        self.recovery.begin_pass(self._mode(contributing, first=False))
        if self.p.restore and not held:
            self.recovery.rewind()
        self.recovery.reduce_all()

    def _extension_pass(self, iteration: int, work, losses: dict[int, float],
                        tokens: dict[int, int]) -> None:
        """Run the extension ids on top of what this replica already counts, then reduce: the
        buckets are rewound to their snapshots (the non-blocking restore, overlapping the pass's
        first forward on CUDA), except those megatron syncs inside the replica after backward,
        which run the pass empty (so the sync sees only the new gradients) and get their
        snapshots added after it. A replica that counted nothing yet starts from empty buckets."""
        self.extended = True
        self.recovery.begin_pass(self._mode(True, first=False))
        extension = work.extension
        counted_before = len(work.contributed) - len(extension)
        if self.p.restore and counted_before > 0:
            self.recovery.rewind_under_pass()
        elif self.p.restore:
            self.recovery.zero()
        self.p.faults.at("during-extension", iteration)
        # A shard may get none of its instance's extension ids: a pass cannot run zero
        # microbatches, and the shard has nothing to add but still joins the reductions (and,
        # with shards in step, runs padding).
        mine, padding = self.share(extension)
        if mine or padding:
            self.p.buffers.new_pass()
            self.run_pass(iteration, mine, losses, tokens, padding)
        self.recovery.restored()  # a shard that ran nothing still reduces the rewound buckets
        if self.p.restore and counted_before > 0:
            self.recovery.add_synced_snapshots()
        self.recovery.reduce_all()

    def _commit(self, iteration, totals, verdict: Verdict, agreed, start,
                events) -> StepReport:
        p = self.p
        b = p.policy.state.b
        inputs = {}
        for check in self.checks:
            inputs.update(check.commit_inputs(verdict.parts.get(check.name)))
        result = p.policy.commit(**inputs)
        if p.per_token_loss:
            # The buckets hold sums over tokens; divide once by the committed ones, as
            # megatron-core's finalize_model_grads does (nothing when every token was masked).
            if verdict.tokens > 0:
                p.buffers.scale(1.0 / verdict.tokens)
        elif result.divisor != b:
            # Losses were divided by B in the pass; drop-and-go divides by what it committed.
            p.buffers.scale(b / result.divisor)
        p.faults.at("optimizer-step", iteration)
        p.buffers.wait_param_gather()  # the step writes this shard into the gathered buffers
        # Every survivor holds the same reduced gradient, so the loss scaler's found-inf decision
        # (taken inside the replica) and its new scale are the same on all of them.
        update_successful, grad_norm = p.optimizer.step(microbatches=b)
        p.buffers.dispatch_param_gather()  # waited for by the next forward
        report = StepReport(
            iteration=iteration, loss=verdict.loss_sum / max(verdict.tokens, 1),
            contributions=totals.count, B=b, live_replicas=len(result.roles), epoch=agreed.epoch,
            ledger_checksum=totals.checksum,
            grad_norm=None if grad_norm is None else float(grad_norm),
            loss_scale=p.optimizer.loss_scale(), skipped=not update_successful,
            iteration_ms=0.0, extension_rounds=len(result.extension_rounds),
            buckets=len(self.recovery.grads), events=events,
            loss_tokens=verdict.tokens if p.per_token_loss else None,
            own_contributions=self._own_contributions, exit_requested=verdict.exit_requested)
        for check in self.checks:
            check.committed(self, iteration, verdict.parts.get(check.name), result, events,
                            report)
        for event in events:
            event["committed"] = time.time()
        report.iteration_ms = (time.perf_counter() - start) * 1e3
        return report

    # -- what checks and the between-steps protocol read --------------------------------------

    def live(self) -> list[int]:
        return sorted(r for r in self.p.policy.layout.replicas if r not in self.dead_replicas)

    def ranks_of(self, replicas) -> list[int]:
        """The world ranks of `replicas` in this position's group."""
        return sorted(rank for rank, replica in self.p.replica_of_rank.items()
                      if replica in replicas)

    def share(self, ids) -> tuple[list[int], int]:
        return share(ids, self.shard, self.shards, self.p.shards_in_step)

    def divisor(self) -> int:
        """What the iteration's loss and gradient are divided by if it commits now."""
        state = self.p.policy.state
        return state.contributions() if state.config.policy == ADAPTIVE else state.b

    def audit_share(self) -> tuple[int, int]:
        """(this rank's index, the count) among the lane's contributors at this position: the
        live members of the cross-replica group, times the replica's shards. Each computes
        1/count of the audit's expected side; a lane redone after a failure splits it again
        over the members that remain."""
        return (self.p.group.rank * self.shards + self.shard, self.p.group.size * self.shards)

    def _reduction_timing(self, schedule_end: float) -> dict:
        """The first round's reductions: the time some reduction was running, and the part of
        it before `schedule_end` (the pass had not returned: hidden under backward with an
        overlapped reduction), in ms; snapshot and gradient-buffer bytes."""
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
