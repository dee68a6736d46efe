"""The resilient training step: first pass, reduce, agree, restore or extend, commit, step.

One `ResilientTrainer.train_step(t)` per iteration, on every rank, drives the three layers over
the interfaces of `interfaces.py` (megatron's DDP, schedule and optimizer behind the adapter of
`megatron_recover.megatron.adapter`; fakes in the unit tier):

  1. The policy says which microbatch ids this replica runs; the pass runner runs them (pipeline
     flush and intra-replica syncs included), then every bucket's ulfm all-reduce is posted
     (layer 2 snapshots each bucket first; a spare zeroes its bucket after the snapshot). With
     --overlap-grad-reduce the first pass posts each bucket from the backward of its last
     microbatch, as megatron would, except the buckets synced inside the replica after backward
     (posted after the pass); extension passes and blocking restores stay deferred.
  2. The commit lane (`lane.CommitLane`) — this replica's loss sum and the gradient ledger its
     buckets sent (which microbatch gradients they hold, with checksums of the batches) — is
     all-reduced on the same group, then a consensus gives every survivor the same failure
     record. The census says whether each survivor's reductions all succeeded under the current
     epoch. The summed ledger is checked by the audit against the failure-free iteration, not
     against the policy's plan.
  3. One verdict per replica (`lane.VerdictCodec`): every intra-replica position (TP x PP rank)
     has its own cross-replica group, and the groups may learn of a dead replica in different
     rounds. The ranks of a replica exchange their views on the replica's control group: the
     dead replicas are the union, and the round commits only if no position saw a failure. Each
     position's record is agreed by all replicas, so every live replica reaches the same verdict;
     the invariant holds only if it holds at every position. A rank whose replica lost a member
     fails in this exchange and leaves (the replica gate).
  4. Otherwise the new dead replicas go to the policy: a promotion or a drop means a blocking
     restore (rewind every bucket, reduce again under the new membership); a boundary means a
     non-blocking one (rewind the buckets, on CUDA on a side stream under the extension pass's
     first forward, run the pass on top, reduce).
     Failures during any of this loop back to 2.
  5. Commit: the policy installs the next layout; the adaptive policy rescales the summed gradient
     to its committed count; the optimizer steps.

The commit lane sums the loss sums and loss tokens of the microbatches in the sent ledger; the
logged loss is their ratio, as Megatron-LM logs it. With per-token loss the pass runner also
leaves each microbatch's gradient a sum over its loss tokens, and the committed gradient is
divided once by the committed token count: all B microbatches' tokens under the static policy,
the committed microbatches' under drop-and-go. Side values (the MoE auxiliary losses) are
summed the same way, then over the replica's ranks after the commit.

With shards in step (expert parallelism inside a replica: the shards exchange tokens in every
forward) every shard runs passes of one length, the shorter shares padded (`share`).

With overlapped parameter gathers (distributed-optimizer instances) every shard dispatches all of
them right after the optimizer step, in the same order (`GradientBuffers.dispatch_param_gather`):
a shard that runs no microbatch in a pass then still joins the all-gathers its peers started.

Every decision is a function of agreed records, so all survivors take the same branch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from megatron_recover.collective import ULFMGroup
from megatron_recover.failures import (
    NonFiniteData,
    NonFiniteResult,
    SilentCorruption,
    Straggler,
    UnresolvedCorruption,
)
from megatron_recover.policy import ADAPTIVE, RESERVE, WorkloadPolicy
from megatron_recover.recovery.gradients import GradientRecovery
from megatron_recover.recovery.interfaces import (
    Audit,
    ControlGroup,
    FaultPoints,
    GradientBuffers,
    OptimizerStep,
    PassRunner,
)
from megatron_recover.recovery.ledger import LaneLayout
from megatron_recover.recovery.lane import (
    CommitLane,
    ExpectedSlots,
    LaneHead,
    SpeedSlots,
    Verdict,
    VerdictCodec,
)
from megatron_recover.recovery.rerun import (
    CHECKER,
    DATA,
    KEEP,
    OFF,
    PERSISTENT,
    TRANSIENT,
    UNKNOWN,
    RerunSlots,
    RerunView,
    checkers,
    classify,
)
from megatron_recover.recovery.verification import (
    Fingerprint,
    Judgement,
    Slots,
    Verification,
    arbiter,
    judge,
    pairs,
    sum_fingerprints,
)


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
    loss_tokens: int | None = None  # per-token loss: the committed loss tokens
    own_contributions: int = 0  # microbatch gradients this rank's buckets sent to the commit
    g_cur: int = 0  # the layout's microbatches per major replica when the iteration began
    exit_requested: bool = False  # some rank asked to stop after this iteration
    # The first round's cross-replica reductions, from the ulfm worker's timestamps: how long
    # some reduction was running, how much of that before the pass returned (hidden under
    # backward), and this rank's snapshot and gradient-buffer bytes.
    reduction: dict = field(default_factory=dict)
    verified: int = 0  # microbatches whose gradients two replicas computed and agreed on
    # Straggler handling (`policy.speed`): each replica's first-pass microbatches in this
    # iteration, the agreed seconds per microbatch, the replicas the next layout treats as slow
    # and the ones evicted at this commit.
    quotas: dict = field(default_factory=dict)
    speeds: dict = field(default_factory=dict)
    slow: list = field(default_factory=list)
    evicted: list = field(default_factory=list)
    side_sums: list = field(default_factory=list)  # TrainerParts.side_sums: committed, replica-wide


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
    current stream time the device's work, and `seconds` waits for the end event (the trainer
    reads it after the pass's reductions, which consumed its gradients: nothing is left to wait
    for). On a machine without CUDA, the host clock."""

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


class ResilientTrainer:
    def __init__(self, parts: TrainerParts):
        self.p = parts
        self.dead_replicas: set[int] = set(parts.dead_replicas)
        # Events between iterations (a join), reported with the next committed iteration.
        self.pending_events: list[dict] = []
        # When this rank last saw every member complete a round (a commit): a victim's last
        # observed progress. A crash is detected soon after; a frozen rank about the hang timeout.
        self._last_progress = time.time()
        self._iteration = 0
        self._extended = False  # an extension pass ran in the iteration in progress
        self._schedule_end = 0.0  # when the first pass's schedule returned (reduction timing)
        self._own_contributions = 0
        config = parts.policy.config
        verify = parts.verification
        self.lane = CommitLane(LaneLayout(config.b, reserve=config.mode == RESERVE
                                          and config.policy != ADAPTIVE),
                               None if verify is None else Slots(config.w_init),
                               None if parts.nonfinite_rerun == OFF
                               else RerunSlots(config.w_init),
                               SpeedSlots(config.w_init) if config.straggler.enabled else None,
                               ExpectedSlots(config.b), side=parts.side_size)
        # This rank's first pass: (its timer, microbatches), then its seconds per microbatch.
        self._speed: tuple | float | None = None
        self._fingerprint = None if verify is None else Fingerprint(verify.seed)
        self._checks: dict[int, int] = {}  # this iteration's owner -> checker
        self._check_ids: dict[int, list[int]] = {}  # owner -> its first-pass ids
        self._fingerprints: dict[str, dict[int, torch.Tensor]] = {}  # what this rank computed
        self._arbiters: dict[int, int] = {}  # owner -> the replica that arbitrates it
        # Non-finite reruns: suspect -> its checker, for the reruns whose findings the next
        # round's lane carries; and what this rank's reruns found non-finite.
        self._reruns: dict[int, int | None] = {}
        self._rerun_ids: dict[int, list[int]] = {}  # suspect -> its first-pass ids
        self._rerun_bad = RerunView()
        self._kept: set[int] = set()  # suspects kept after a finite rerun, this iteration
        self.verdicts = VerdictCodec(config.w_init, speeds=config.straggler.enabled)
        self.recovery = GradientRecovery(parts.group, parts.buffers.buckets(),
                                         before_first_reduce=self._before_reduce,
                                         after_first_post=self._after_post,
                                         shard_group=parts.shard_group,
                                         shard_groups=parts.bucket_shard_groups,
                                         deferred=parts.buffers.deferred(),
                                         synced=parts.buffers.synced(),
                                         check_finite=parts.check_finite,
                                         restore_stream=(torch.cuda.Stream(
                                             device=parts.buffers.buckets()[0].device)
                                             if torch.cuda.is_available() else None))
        if parts.shard_control is None:
            self._shard, self._shards = 0, 1
        else:
            self._shard, self._shards = parts.shard_control.rank, parts.shard_control.size

    @property
    def shard(self) -> tuple[int, int]:
        """(this rank's shard, shards) of its replica's data-parallel ranks: (0, 1) without
        distributed-optimizer instances."""
        return self._shard, self._shards

    def gather_parameters(self) -> None:
        """Wait for this rank's parameter all-gathers: the model's parameters are then the ones
        the last step produced on every shard (nothing to do without overlapped gathers)."""
        self.p.buffers.wait_param_gather()

    def _before_reduce(self) -> None:
        self.p.faults.at("before-reduce", self._iteration)
        self.p.faults.corrupt(self._iteration, self.recovery.grads[0])

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
        work = p.policy.work(p.replica)
        losses: dict[int, float] = {}
        tokens: dict[int, int] = {}
        # As Megatron-LM's train_step: without dropping the grads the optimizer left aliasing
        # the buffers, backward would add each first microbatch's gradient twice.
        p.buffers.zero()
        p.optimizer.zero_grad()
        self.recovery.begin_iteration()
        self._extended = False
        self._reruns, self._rerun_ids, self._rerun_bad, self._kept = {}, {}, RerunView(), set()
        self.recovery.hold_nonfinite = p.nonfinite_rerun != OFF
        self._begin_checks(iteration)
        self.recovery.begin_pass()
        self.recovery.contributing = work.contributes_first_pass
        p.faults.at("pre-forward", iteration)
        self._run(iteration, *self._share(work.first_pass), losses, tokens,
                  overlap=p.overlap_grad_reduce, first=True)
        if self.recovery.fingerprint is not None:  # every bucket went out: each fingerprinted
            self._fingerprints["own"] = {p.replica: sum_fingerprints(self.recovery.fingerprints)}
            self.recovery.fingerprint = None  # re-reductions send the same or other ids
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
            totals, problems, judgement, side = None, [], None, []
            round_ok = not agreed.failed_ranks and agreed.census[0] == agreed.size
            summed = self.lane.decode_head(lane)
            if round_ok:
                # This position's round succeeded everywhere: its lane is the committed ledger.
                totals = self.lane.decode_ledger(lane)
                side = self.lane.decode_side(lane)
                # Only the last pipeline stage saw the loss tokens.
                counted = summed.tokens if p.per_token_loss and p.computes_loss else None
                problems = p.audit.problems(iteration, totals, self._divisor(), counted,
                                            self.lane.decode_expected(lane))
                if p.verification is not None:
                    judgement = judge(self.lane.decode_fingerprints(lane), self._checks,
                                      self._live(), p.verification.tolerance)
            verdict = self._replica_verdict(agreed, summed, not round_ok, bool(problems),
                                            judgement,
                                            self.lane.decode_reruns(lane) if round_ok else None,
                                            self.lane.decode_speeds(lane) if round_ok else None)
            held = self._reruns or verdict.reruns.nonfinite - self.dead_replicas
            if verdict.commit and not verdict.corrupt and not held:
                self._last_progress = time.time()
                break
            detected = time.time()
            cause = None
            if verdict.commit and held:  # a first pass was held out as non-finite
                new_dead = self._on_nonfinite(iteration, verdict, events, detected)
                ranks = sorted(rank for rank, replica in p.replica_of_rank.items()
                               if replica in new_dead)
                cause = "non-finite gradient"
                if not new_dead:  # reruns to run, or a transient fault kept
                    self._blocking_restore(iteration, work)
                    events[-1]["restored"] = time.time()
                    continue
            elif verdict.commit:  # no failure, but two replicas computed different gradients
                new_dead = self._on_corruption(iteration, verdict, events, detected)
                ranks = sorted(rank for rank, replica in p.replica_of_rank.items()
                               if replica in new_dead)
                cause = "silent corruption"
                if not new_dead:  # arbitrated: reduce the same contributions again
                    self._blocking_restore(iteration, work)
                    events[-1]["restored"] = time.time()
                    continue
            else:
                new_dead = sorted(verdict.dead - self.dead_replicas)
                ranks = list(agreed.failed_ranks)
                new_dead = self._interrupt_reruns(iteration, new_dead)
            if new_dead:
                self.dead_replicas.update(new_dead)
                decision = p.policy.on_failure(new_dead)
                work = p.policy.work(p.replica)
                events.append({"event": "failure", "replicas": new_dead,
                               "ranks": ranks, "epoch": agreed.epoch,
                               "detected": detected, "repaired": detected,
                               "since_last_progress_s": detected - self._last_progress,
                               "restore": decision.restore_mode, "g_ext": decision.g_ext,
                               "promotions": [list(x) for x in decision.promotions]})
                if cause is not None:
                    events[-1]["cause"] = cause
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
        report.side_sums = self._replica_side(side)
        report.reduction = reduction
        report.g_cur = state.layout.g_cur
        report.verified = self._verified(judgement)
        report.quotas = {r: len(w.first_pass) for r, w in state.work.items()
                         if w.contributes_first_pass}
        return report

    def _replica_side(self, side: list[float]) -> list[float]:
        """The committed side sums of this position, summed over the replica's positions (TP
        pieces and pipeline stages; the shards' lanes were summed already: shard 0 counts)."""
        if not side:
            return []
        vector = torch.tensor(side, dtype=torch.float64) * float(self._shard == 0)
        if self.p.replica_control is not None:
            self.p.replica_control.sum(vector)  # a dead peer raises: the rank leaves
        return vector.tolist()

    def _verified(self, judgement: Judgement | None) -> int:
        """Microbatches of the committed round whose owner's and checker's fingerprints
        agreed."""
        if judgement is None:
            return 0
        return sum(len(self._check_ids[owner]) for owner in judgement.checked)

    def _live(self) -> list[int]:
        return sorted(r for r in self.p.policy.layout.replicas if r not in self.dead_replicas)

    def _begin_checks(self, iteration: int) -> None:
        """Sampled verification: which owners are checked this iteration, and by whom; this
        replica runs the first pass of the owner it checks from empty buffers, fingerprints it
        and empties the buffers again, so its own pass starts as it would without checks."""
        p, verify = self.p, self.p.verification
        self._checks, self._check_ids, self._fingerprints, self._arbiters = {}, {}, {}, {}
        if verify is None:
            return
        live = self._live()
        owners = [r for r in live if p.policy.work(r).contributes_first_pass
                  and p.policy.work(r).first_pass]
        self._checks = pairs(verify.seed, iteration, owners, live, verify.rate)
        self._check_ids = {owner: list(p.policy.work(owner).first_pass) for owner in self._checks}
        for owner, checker in self._checks.items():
            if checker == p.replica:
                self._fingerprints["check"] = {owner: self._run_for(iteration,
                                                                    self._check_ids[owner])}
                p.buffers.zero()
                p.optimizer.zero_grad()
                self.recovery.begin_iteration()
        if p.replica in self._checks:
            self.recovery.fingerprint = self._fingerprint.bucket
            self.recovery.fingerprints = {}

    def _run_for(self, iteration: int, ids: list[int]) -> torch.Tensor | None:
        """Run a replica's `ids` (this rank's share of them) on empty buckets and return their
        fingerprint (None without sampled verification); the buckets then hold that gradient
        (the caller empties, rewinds or keeps them). Losses are not reported: the replica
        whose ids they are reports its own."""
        self.recovery.zero()
        mine, padding = self._share(ids)
        if mine or padding:
            self.p.buffers.new_pass()
            self._pass(iteration, mine, {}, {}, padding)
        if self._fingerprint is None:
            return None
        return self._fingerprint.buckets(self.recovery.grads)

    def _on_corruption(self, iteration: int, verdict: Verdict, events: list[dict],
                       detected: float) -> list[int]:
        """Two replicas' fingerprints of the same ids differ. With an arbitration's result: the
        replicas to evict (this rank raises if its replica is one); before one: this
        iteration's arbiters rerun the suspects' ids (nothing to evict yet). Without a possible
        arbitration the job ends."""
        p = self.p
        if verdict.unresolved:
            owner = min(verdict.unresolved)
            third = self._arbiters.get(owner)
            why = (f"replica {third}, which ran them a third time, agrees with neither"
                   if third is not None else "no third live replica can tell which is right")
            raise UnresolvedCorruption(
                f"iteration {iteration}: replicas {owner} and {self._checks[owner]} computed "
                f"different gradients for microbatches {self._check_ids[owner]}, and {why}; "
                "nothing of the iteration is committed (kernels that are not deterministic "
                "need a measured --recover-sdc-tolerance)")
        if verdict.evict:
            evicted = sorted(verdict.evict)
            events.append({"event": "corruption", "evicted": evicted, "detected": detected,
                           "owners": sorted(o for o, c in self._checks.items()
                                            if {o, c} & set(evicted))})
            if p.replica in verdict.evict:
                raise SilentCorruption(
                    f"iteration {iteration}: this replica's gradient fingerprint differs from "
                    "what two other replicas computed for the same microbatches: its device is "
                    "taken for faulty and the replica leaves before the commit")
            return sorted(verdict.evict - self.dead_replicas)
        live = self._live()
        for owner in sorted(verdict.suspects):
            self._arbiters[owner] = arbiter(owner, self._checks[owner], live)
        events.append({"event": "mismatch", "owners": sorted(verdict.suspects),
                       "checkers": [self._checks[o] for o in sorted(verdict.suspects)],
                       "arbiters": [self._arbiters[o] for o in sorted(verdict.suspects)],
                       "detected": detected})
        for owner in sorted(verdict.suspects):
            if self._arbiters[owner] == p.replica:
                self._fingerprints.setdefault("arbiter", {})[owner] = self._run_for(
                    iteration, self._check_ids[owner])
                self.recovery.rewind()  # back to what this replica reduced
        return []

    def _on_nonfinite(self, iteration: int, verdict: Verdict, events: list[dict],
                      detected: float) -> list[int]:
        """Some replica's first pass failed the NaN/inf check and was held out of the round.
        Before reruns: each suspect reruns its ids in place and its checker runs them too
        (nothing to evict yet). After them (this round's lane carried their findings): the
        replicas to evict (this rank raises if its replica is one, and every rank raises when
        the microbatches themselves give a non-finite gradient); a transient fault kept
        (`keep`) contributes its rerun's gradient from the next round on."""
        p = self.p
        if not self._reruns:
            suspects = sorted(verdict.reruns.nonfinite - self.dead_replicas)
            again = sorted(set(suspects) & self._kept)
            if again:  # kept after a finite rerun, non-finite again in the same iteration
                events.append({"event": "rerun", "outcomes": {str(n): PERSISTENT for n in again},
                               "evicted": again, "kept": [], "detected": detected})
                if p.replica in again:
                    raise NonFiniteResult(
                        f"iteration {iteration}: this replica's gradient was non-finite again "
                        "after its rerun had been kept: its device is taken for faulty; the "
                        "replica leaves before the commit")
                return again
            self._reruns = checkers(suspects, self._live())
            self._rerun_ids = {n: list(p.policy.work(n).first_pass) for n in suspects}
            events.append({"event": "nonfinite", "replicas": suspects,
                           "checkers": [self._reruns[n] for n in suspects],
                           "detected": detected})
            # A checker first (a suspect may check another when only suspects are left), then
            # the suspect's own rerun, which stays in its buckets.
            check_bad = frozenset(n for n in suspects if self._reruns[n] == p.replica
                                  and self._check_rerun(iteration, n))
            own_bad = frozenset(n for n in suspects if n == p.replica
                                and self._rerun(iteration, n))
            self._rerun_bad = RerunView(own_bad=own_bad, check_bad=check_bad)
            return []
        outcomes = {n: classify(n in verdict.reruns.own_bad, checker,
                                n in verdict.reruns.check_bad)
                    for n, checker in self._reruns.items()}
        events.append({"event": "rerun", "outcomes": {str(n): o for n, o in outcomes.items()},
                       "checkers": {str(n): c for n, c in self._reruns.items()},
                       "detected": detected})
        data = sorted(n for n, o in outcomes.items() if o in (DATA, UNKNOWN))
        if data:
            raise NonFiniteData(self._data_message(iteration, data[0], self._reruns[data[0]]))
        evict = {n for n, o in outcomes.items()
                 if o == PERSISTENT or (o in (TRANSIENT, CHECKER) and p.nonfinite_rerun != KEEP)}
        evict |= {self._reruns[n] for n, o in outcomes.items() if o == CHECKER}
        kept = sorted(set(outcomes) - evict)
        events[-1].update(evicted=sorted(evict), kept=kept)
        if p.replica in evict:
            raise NonFiniteResult(self._evicted_message(iteration, outcomes))
        self._reruns, self._rerun_bad = {}, RerunView()
        self._kept.update(kept)
        if p.replica in kept:
            self.recovery.nonfinite = False  # its buckets' snapshot holds the rerun's gradient
        return sorted(evict - self.dead_replicas)

    def _evicted_message(self, iteration: int, outcomes: dict[int, str]) -> str:
        """Why this rank's replica is evicted after the reruns (`outcomes` by suspect)."""
        me = self.p.replica
        if me in outcomes:  # a suspect: persistent, or transient (its checker's run may
            # have failed too: CHECKER) and evicted as the flag asks
            why = ("again when this replica ran them a second time, and not on replica "
                   f"{self._reruns[me]}: its device is taken for faulty"
                   if outcomes[me] == PERSISTENT else
                   "once, not when this replica ran them again: a transient fault, evicted as "
                   "--recover-nonfinite-rerun evict asks")
            ids = self._rerun_ids[me]
        else:
            suspect = next(n for n, o in outcomes.items()
                           if o == CHECKER and self._reruns[n] == me)
            ids = self._rerun_ids[suspect]
            why = (f"when this replica ran them, and not when replica {suspect}, whose "
                   "microbatches they are, ran them again: its device is taken for faulty")
        return (f"iteration {iteration}: microbatches {ids} gave a non-finite gradient {why}; "
                "the replica leaves before the commit")

    def _rerun(self, iteration: int, suspect: int) -> bool:
        """This replica is `suspect`: run its first-pass ids again from empty buffers; whether
        the gradient is non-finite. The buckets keep the rerun's gradient: the next round's
        reductions snapshot it (and send zeros), so a kept replica contributes it afterwards."""
        fingerprint = self._run_for(iteration, self._rerun_ids[suspect])
        if fingerprint is not None and "own" in self._fingerprints:
            self._fingerprints["own"] = {suspect: fingerprint}  # what it would now send
        return self.recovery.any_nonfinite()

    def _check_rerun(self, iteration: int, suspect: int) -> bool:
        """This replica checks `suspect`: run its ids from empty buffers; whether the gradient
        is non-finite. The buckets then hold it: the restore that follows rewinds them (or this
        replica's own rerun empties them first)."""
        self._run_for(iteration, self._rerun_ids[suspect])
        return self.recovery.any_nonfinite()

    def _data_message(self, iteration: int, suspect: int, checker: int | None) -> str:
        ids = self._rerun_ids[suspect]
        where = (f"on replica {suspect} twice and on replica {checker}" if checker is not None
                 else f"on replica {suspect} twice, and no other replica is left to tell the "
                      "data from the device")
        samples = ""
        if self.p.samples_of is not None:
            ranges = [self.p.samples_of(iteration, k) for k in ids]
            samples = " (samples " + ", ".join(
                f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in ranges) + ")"
        return (f"iteration {iteration}: microbatches {ids}{samples} give a non-finite gradient "
                f"{where}: the data or the model's state is at fault, not a device; nothing of "
                "the iteration is committed")

    def _interrupt_reruns(self, iteration: int, new_dead: list[int]) -> list[int]:
        """A replica died while suspects were being classified: the suspects leave too, as
        without reruns (their microbatches are redone with the dead replicas')."""
        if not self._reruns:
            return new_dead
        suspects = set(self._reruns) - self.dead_replicas
        self._reruns, self._rerun_bad = {}, RerunView()
        if self.p.replica in suspects:
            raise NonFiniteResult(
                f"iteration {iteration}: this replica's gradient was non-finite and a failure of "
                f"replica(s) {new_dead} interrupted its rerun: it leaves as without "
                "--recover-nonfinite-rerun")
        return sorted(set(new_dead) | suspects)

    def add_event(self, event: dict) -> None:
        """An event between iterations (a join): reported with the next committed iteration."""
        self.pending_events.append(event)

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
            values = run_ids(*self._share(range(live.index(p.replica), count, len(live))))
            if p.shard_control is not None:
                p.shard_control.sum(values)  # the shards split the replica's ids
            record = p.group.allreduce(values).wait()
            ok = int(not record.has_failure and record.epoch == p.group.epoch)
            agreed = p.group.consensus([ok]).wait()
            round_ok = not agreed.failed_ranks and agreed.census[0] == agreed.size
            verdict = self._replica_verdict(agreed, nothing, not round_ok, ledger_bad=False)
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
        if p.replica_control is not None:
            # Only the last pipeline stage ran the loss: the others hold zeros.
            p.replica_control.max(values)
        return values, events

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

    def _share(self, ids) -> tuple[list[int], int]:
        return share(ids, self._shard, self._shards, self.p.shards_in_step)

    def _divisor(self) -> int:
        """What the iteration's loss and gradient are divided by if it commits now."""
        state = self.p.policy.state
        return state.contributions() if state.config.policy == ADAPTIVE else state.b

    def _lane(self, iteration: int, losses: dict[int, float],
              tokens: dict[int, int]) -> torch.Tensor:
        """This rank's commit lane: the loss sum and loss tokens of the ids in its sent ledger
        (so the logged loss is the loss of the gradients that were reduced; each id's loss is on
        the last pipeline stage that ran it), its exit request, and the ledger; with
        distributed-optimizer shards, summed over the replica's shards (the union of their
        ledgers, as the reduce-scatter summed their gradients)."""
        sent, consistent = self.recovery.sent_ledger()
        self._own_contributions = 0 if sent is None else sum(sent.entries.values())
        loss_sum, token_sum = 0.0, 0
        if sent is not None and self.p.computes_loss:
            loss_sum = sum(n * losses.get(k, float("nan")) for (_, k, _), n in sent.entries.items())
            token_sum = sum(n * tokens.get(k, 0) for (_, k, _), n in sent.entries.items())
        head = LaneHead(loss_sum, token_sum, self.p.wants_exit())
        side = None
        if self.p.side_size and sent is not None:
            counts: dict[int, int] = {}
            for (_, k, _), n in sent.entries.items():
                counts[k] = counts.get(k, 0) + n
            side = self.p.side_sums(iteration, counts)
        reruns = replace(
            self._rerun_bad,
            nonfinite=frozenset([self.p.replica] if self.recovery.nonfinite else []))
        lane = self.lane.encode(head, sent, iteration, poison=int(not consistent),
                                fingerprints=self._fingerprints, reruns=reruns,
                                speed=(self.p.replica, self._seconds_per_microbatch()),
                                expected=self.p.audit.share(iteration, *self._audit_share()),
                                side=side)
        if self.p.shard_control is not None:
            self.p.shard_control.sum(lane)  # intra-replica, as the reduce-scatter
        return lane

    def _audit_share(self) -> tuple[int, int]:
        """(this rank's index, the count) among the lane's contributors at this position: the
        live members of the cross-replica group, times the replica's shards. Each computes
        1/count of the audit's expected side; a lane redone after a failure splits it again
        over the members that remain."""
        return (self.p.group.rank * self._shards + self._shard,
                self.p.group.size * self._shards)

    def _seconds_per_microbatch(self) -> float | None:
        """This rank's first pass: seconds per microbatch (None: it ran none, or nobody asks).
        Read once the pass's reductions completed: on CUDA its end event is then long done."""
        if self._speed is None or self.lane.speeds is None:
            return None
        if isinstance(self._speed, tuple):
            timer, microbatches = self._speed
            self._speed = timer.seconds() / microbatches
        return self._speed

    def _replica_verdict(self, agreed, summed: LaneHead, failed: bool,
                         ledger_bad: bool, judgement: Judgement | None = None,
                         reruns: RerunView | None = None,
                         speeds: dict[int, float] | None = None) -> Verdict:
        """The round's outcome for this replica, equal on all of its ranks: this position's
        view (`agreed` record, the summed lane's head, whether its round failed, whether its
        audit found a problem, what its fingerprints say, its non-finite flags and the
        replicas' times per microbatch), combined with the replica's other positions."""
        p = self.p
        dead = {p.replica_of_rank[rank] for rank in agreed.failed_ranks}
        vector = self.verdicts.encode(dead, failed, summed, ledger_bad, judgement, reruns,
                                      speeds)
        if p.replica_control is not None:
            # A peer that died makes this raise; the rank then leaves with its replica.
            p.replica_control.max(vector)
        return self.verdicts.decode(vector)

    def _pass(self, iteration: int, ids: list[int], losses: dict[int, float],
              tokens: dict[int, int], padding: int = 0) -> "PassTimer":
        """The pass runner on `ids` and `padding` (and a slowdown the failure schedule asks
        for), timed."""
        timer = PassTimer()
        self.p.run_pass(iteration, ids, self.p.policy.state.b, losses, tokens, padding)
        timer.stop()
        self.p.faults.slow_down(iteration, len(ids), timer.seconds)
        timer.stop()  # the slowdown is part of the pass
        return timer

    def _run(self, iteration: int, ids: list[int], padding: int, losses: dict[int, float],
             tokens: dict[int, int], overlap: bool = False, first: bool = False) -> None:
        """Run `ids` (possibly none: every rank still joins the reductions) through the pass
        runner, then post every bucket's reduction not posted during its backward (`overlap`).
        The first pass's seconds per microbatch go to the commit lane (`first`): the
        replica's compute, without any wait on other replicas (none happens inside a pass)."""
        if first:
            self._speed = None
        if ids or padding:
            if overlap:
                self.recovery.start_overlap()
            try:
                timer = self._pass(iteration, ids, losses, tokens, padding)
            finally:
                self.recovery.stop_overlap()
            if first and ids:  # per microbatch run, padding included (it costs the same)
                self._speed = (timer, len(ids) + padding)
        self._schedule_end = time.time()  # what reduce_all posts now was not under backward
        self.recovery.reduce_all()

    def _blocking_restore(self, iteration: int, work) -> None:
        """Rewind every bucket and reduce it again under the new membership and roles.

        The snapshot holds what the replica's latest reduction started from: its first pass
        (which an unpromoted spare keeps out of the reduce) or, after an extension pass, exactly
        the ids it contributes (extension ids, plus its earlier contributions added back).
        A suspect of a non-finite gradient under classification keeps its rerun in the buckets
        and holds it out (`_on_nonfinite`).
        """
        self.p.faults.at("during-restore", iteration)
        held = self.p.replica in self._reruns
        self.recovery.begin_pass()
        if self.p.restore and not held:
            self.recovery.rewind()
        self.recovery.contributing = (work.contributes_first_pass or self._extended) and not held
        self.recovery.reduce_all()

    def _extension_pass(self, iteration: int, work, losses: dict[int, float],
                        tokens: dict[int, int]) -> None:
        """Run the extension ids on top of what this replica already counts, then reduce: the
        buckets are rewound to their snapshots (the non-blocking restore, overlapping the pass's
        first forward on CUDA), except those megatron syncs inside the replica after backward,
        which run the pass empty (so the sync sees only the new gradients) and get their
        snapshots added after it. A replica that counted nothing yet starts from empty buckets."""
        self.recovery.begin_pass()
        self._extended = True
        self.recovery.hold_nonfinite = False  # reruns classify first passes only
        extension = work.extension
        counted_before = len(work.contributed) - len(extension)
        if self.p.restore and counted_before > 0:
            self.recovery.rewind_under_pass()
        elif self.p.restore:
            self.recovery.zero()
        self.recovery.contributing = True
        self.p.faults.at("during-extension", iteration)
        # A shard may get none of its instance's extension ids: a pass cannot run zero
        # microbatches, and the shard has nothing to add but still joins the reductions (and,
        # with shards in step, runs padding).
        mine, padding = self._share(extension)
        if mine or padding:
            self.p.buffers.new_pass()
            self._pass(iteration, mine, losses, tokens, padding)
        self.recovery.restored()  # a shard that ran nothing still reduces the rewound buckets
        if self.p.restore and counted_before > 0:
            self.recovery.add_synced_snapshots()
        self.recovery.reduce_all()

    def _commit(self, iteration, totals, problems, verdict: Verdict, agreed, start,
                events) -> StepReport:
        p = self.p
        b = p.policy.state.b
        result = p.policy.commit(verdict.speeds)
        divisor = result.divisor
        if p.per_token_loss:
            # The buckets hold sums over tokens; divide once by the committed ones, as
            # megatron-core's finalize_model_grads does (nothing when every token was masked).
            divisor = verdict.tokens
            if divisor > 0:
                p.buffers.scale(1.0 / divisor)
        elif result.divisor != b:
            # Losses were divided by B in the pass; drop-and-go divides by what it committed.
            p.buffers.scale(b / result.divisor)
        p.faults.at("optimizer-step", iteration)
        self.gather_parameters()  # the step writes this shard into the gathered buffers
        # Every survivor holds the same reduced gradient, so the loss scaler's found-inf decision
        # (taken inside the replica) and its new scale are the same on all of them.
        update_successful, grad_norm = p.optimizer.step(microbatches=b)
        p.buffers.dispatch_param_gather()  # waited for by the next forward
        if result.evicted:
            self._evict_stragglers(iteration, result, events)
        for event in events:
            event["committed"] = time.time()
        return StepReport(
            iteration=iteration, loss=verdict.loss_sum / max(verdict.tokens, 1),
            contributions=totals.count, B=b,
            live_replicas=len(result.roles), epoch=agreed.epoch,
            ledger_checksum=totals.checksum, invariant_ok=verdict.invariant_ok,
            ledger_problems=problems,
            grad_norm=None if grad_norm is None else float(grad_norm),
            loss_scale=p.optimizer.loss_scale(), skipped=not update_successful,
            iteration_ms=(time.perf_counter() - start) * 1e3,
            extension_rounds=len(result.extension_rounds),
            buckets=len(self.recovery.grads), events=events,
            loss_tokens=verdict.tokens if p.per_token_loss else None,
            own_contributions=self._own_contributions,
            exit_requested=verdict.exit_requested,
            speeds=dict(sorted(verdict.speeds.items())), slow=sorted(result.slow),
            evicted=sorted(result.evicted))

    def _evict_stragglers(self, iteration: int, result, events: list[dict]) -> None:
        """The measured speeds evicted replicas at this commit (fail-slow made fail-stop): the
        next layout is without them, and their ranks leave after this step, as a failed
        replica's would; the survivors' next round sees them gone (a retry, no new failure)."""
        p = self.p
        window = p.policy.config.straggler.window
        evicted = sorted(result.evicted)
        events.append({"event": "straggler", "evicted": evicted,
                       "ratios": {str(r): round(result.ratios[r], 3) for r in evicted},
                       "window": window, "detected": time.time()})
        self.dead_replicas.update(evicted)
        if p.replica in result.evicted:
            raise Straggler(
                f"iteration {iteration}: this replica's first pass took "
                f"{result.ratios[p.replica]:.2f} times the other replicas' median per microbatch, "
                f"past --recover-evict-slower-than {p.policy.config.straggler.evict_slower_than:g}"
                f" for {window} iterations: it leaves after this step as a failed replica would")
