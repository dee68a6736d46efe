"""`WorkloadPolicy`: the stateful face of a policy that the recovery layer and schedules hold.

Every rank of every replica holds one, built from the same `PolicyConfig`. Driven identically —
`begin` at the start of an iteration, `on_failure` with each agreed failure record, `commit` after
the optimizer step — all instances stay equal without exchanging a message, because each method is
a pure function of the state and the record (see `static` and `adaptive`).

Typical use by the glue, per iteration:

    policy.begin(iteration)
    work = policy.work(my_replica)                # first-pass ids; contributes?
    ... run work.first_pass, reduce ...
    while the consensus reports a failure record:
        decision = policy.on_failure(record.failed)
        ... restore (decision.restore_mode); if decision.boundary run policy.work(me).extension ...
    result = policy.commit(times)                 # result.divisor scales the gradient

`times` are the replicas' agreed first-pass seconds per microbatch: with a `StragglerConfig` the
policy balances its next layout by them, or evicts a replica far slower than the others
(`speed.py`; `result.evicted`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

from megatron_recover.policy import adaptive, speed, static
from megatron_recover.policy.layout import ADAPTIVE, PolicyConfig, advance_layout, balanced_layout
from megatron_recover.policy.decisions import (
    IterationResult,
    IterationState,
    PolicyDecision,
    RankWork,
    rank_work,
)


class WorkloadPolicy:
    """The policy of one run: its current layout and the iteration in progress.

    Not thread-safe; one instance per process. Raises ValueError when driven out of order
    (begin twice, commit without begin) or with a record naming a replica that is not live.
    """

    def __init__(self, config: PolicyConfig):
        self.config = config
        self._impl = adaptive if config.policy == ADAPTIVE else static
        self.layout = self._impl.initial_layout(config)
        self.last_committed = 0
        self._reserve_next = 0
        self._state: IterationState | None = None
        # The measured speeds' history (`speed.SpeedState`): equal on every rank, sent to joiners.
        self.speeds = speed.SpeedState()

    @classmethod
    def resume(cls, config: PolicyConfig, layout, last_committed: int,
               reserve_next: int, speeds: speed.SpeedState | None = None) -> "WorkloadPolicy":
        """The policy of a run resumed from a checkpoint: it continues from `layout` (its live
        replicas are original replica ids) with the iteration after `last_committed`; `speeds`:
        the live replicas' speed history (a joiner takes its donor's; a relaunch starts
        without)."""
        policy = cls(config)
        policy.layout = layout
        policy.last_committed = last_committed
        policy._reserve_next = reserve_next
        if speeds is not None:
            policy.speeds = speeds
        return policy

    @property
    def reserve_next(self) -> int:
        """The next unused position of the reserve stream (reserve mode)."""
        return self._reserve_next

    @property
    def state(self) -> IterationState:
        """The iteration in progress."""
        if self._state is None:
            raise ValueError("no iteration in progress: call begin() first")
        return self._state

    @property
    def in_iteration(self) -> bool:
        return self._state is not None

    def begin(self, iteration: int | None = None) -> IterationState:
        """Start `iteration` (default: the one after the last commit) from the current layout."""
        if self._state is not None:
            raise ValueError(f"iteration {self._state.iteration} is still in progress")
        iteration = self.last_committed + 1 if iteration is None else iteration
        if iteration <= self.last_committed:
            raise ValueError(f"iteration {iteration} was already committed")
        self._state = self._impl.begin_iteration(
            self.config, self.layout, iteration, self._reserve_next
        )
        return self._state

    def on_failure(self, failed: Iterable[int]) -> PolicyDecision:
        """Apply one agreed failure record (the replicas that died since the last record)."""
        self._state, decision = self._impl.apply_failure(self.state, failed)
        return decision

    def drop(self, failed: Iterable[int]) -> None:
        """Between iterations (an evaluation), remove dead replicas from the layout: the next
        iteration starts on the survivors, as after a boundary iteration."""
        if self._state is not None:
            raise ValueError(f"iteration {self._state.iteration} is in progress: a failure in "
                             "it goes to on_failure")
        failed = set(failed)
        unknown = failed - set(self.layout.replicas)
        if unknown or failed == set(self.layout.replicas):
            raise ValueError(f"cannot drop replicas {sorted(failed)} from the live "
                             f"{list(self.layout.replicas)}")
        self.layout = self._impl.without(self.layout, failed)
        self.speeds = self.speeds.forget(failed)

    def grow(self, joined: Iterable[int]) -> None:
        """Between iterations, replicas `joined` (ids of dead replicas, taken by standbys) come
        back: the next iteration starts on the grown layout, B unchanged."""
        if self._state is not None:
            raise ValueError(f"iteration {self._state.iteration} is in progress: replicas join "
                             "between iterations")
        joined = set(joined)
        back = joined & set(self.layout.replicas)
        if back or not all(0 <= r < self.config.w_init for r in joined):
            raise ValueError(f"cannot grow replicas {sorted(joined)} into the live "
                             f"{list(self.layout.replicas)} (ids 0..{self.config.w_init - 1})")
        self.layout = self._impl.with_replicas(self.layout, joined)
        self.speeds = self.speeds.forget(joined)  # a standby's speed is not the old replica's

    def work(self, replica: int) -> RankWork:
        """What `replica` runs and contributes in the iteration in progress."""
        return rank_work(self.state, replica)

    def num_microbatches(self, replica: int) -> int:
        """First-pass microbatches of `replica` in the iteration in progress, or, between
        iterations, in the next one."""
        state = self._state
        if state is None:  # the next iteration may re-lay out (a batch-size ramp-up step)
            state = self._impl.begin_iteration(self.config, self.layout, self.last_committed + 1,
                                               self._reserve_next)
        return rank_work(state, replica).num_microbatches

    @property
    def iteration(self) -> int:
        """The iteration in progress or, between iterations, the next one."""
        return self.last_committed + 1 if self._state is None else self._state.iteration

    def commit(self, times: Mapping[int, float] | None = None) -> IterationResult:
        """Close the iteration in progress and install the next layout. `times`: replica ->
        its first pass's seconds per microbatch, agreed by every rank (straggler handling)."""
        result = self._impl.commit_iteration(self.state)
        if self.config.straggler.enabled:
            result = self._follow_speeds(result, times or {})
        self.layout = result.next_layout
        self._reserve_next = result.next_reserve
        self.last_committed = result.iteration
        self._state = None
        return result

    def _follow_speeds(self, result: IterationResult,
                       times: Mapping[int, float]) -> IterationResult:
        """The next layout by the measured speeds: balanced while a replica is marked slow,
        Algorithm 7 otherwise; evicted replicas are left out of it."""
        b_next = self.config.b_at(result.iteration + 1)
        self.speeds, decision = speed.observe(self.config.straggler, self.speeds, times,
                                              result.roles, b_next)
        layout = result.next_layout
        survivors = [r for r in layout.replicas if r not in decision.evict]
        if decision.quotas is not None:
            layout = balanced_layout(dict(decision.quotas), b_next)
        elif decision.evict or layout.quotas:
            layout = advance_layout(survivors, b_next)
        return replace(result, next_layout=layout, evicted=decision.evict,
                       slow=self.speeds.marked, ratios=dict(decision.ratios))


class PolicyNumMicroBatchesCalculator:
    """A microbatch calculator with megatron-core's interface (0.16.1 and 0.19.0), answered from
    the policy.

    Duck-types `megatron.core.num_microbatches_calculator.NumMicroBatchesCalculator` (get,
    get_current_global_batch_size, get_micro_batch_size, get_current_running_global_batch_size,
    update) without importing megatron; the glue installs it as megatron-core's global
    calculator under --recover, so megatron code asking `get_num_microbatches()` gets this
    rank's count. `get()` is the microbatches this data-parallel rank runs in the first pass of
    the iteration in progress (or the next one): its replica's, every `shards`-th from `shard` when
    the replica holds several data-parallel ranks. It changes with roles and with the batch-size
    schedule the policy was configured with, not with consumed samples, so `update` does
    nothing. The global batch size is the iteration's B micro-batches; the running one is what the
    policy commits in a failure-free iteration (B for the static policy, the survivors' slices for
    the adaptive one).
    """

    def __init__(self, policy: WorkloadPolicy, replica: int, micro_batch_size: int,
                 shard: int = 0, shards: int = 1):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if not 0 <= replica < policy.config.w_init:
            raise ValueError(f"replica {replica} does not exist (0..{policy.config.w_init - 1})")
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} does not exist (0..{shards - 1})")
        self.policy = policy
        self.replica = replica
        self.micro_batch_size = micro_batch_size
        self.shard, self.shards = shard, shards

    def get(self) -> int:
        return len(range(self.shard, self.policy.num_microbatches(self.replica), self.shards))

    def get_current_global_batch_size(self) -> int:
        return self.policy.config.b_at(self.policy.iteration) * self.micro_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size

    def get_current_running_global_batch_size(self) -> int:
        if self.policy.config.policy == ADAPTIVE:
            config = self.policy.config
            g = config.b_at(self.policy.iteration) // config.w_init
            return len(self.policy.layout.replicas) * g * self.micro_batch_size
        return self.get_current_global_batch_size()

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        """Nothing to do: the policy moves on at begin and commit, not with consumed samples."""
