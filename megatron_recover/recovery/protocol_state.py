"""`ProtocolState`: everything the recovery protocol needs to continue a run, as one value.

Checkpoints (under `recover_state`, beside Megatron-LM's keys), node snapshots and a standby's
join all carry the same entry, `ProtocolState.state_dict()`, so a relaunch resumes what a join
resumes: the policy (layout, last commit, reserve pointer, the straggler history), the replicas
known dead, and the reserve ids committed so far in the run. The training state (model,
optimizer, scheduler, generators, digests) travels beside it, as before.

    state = capture(trainer, iteration)            # between iterations, on any live rank
    saved = state.state_dict()                     # plain values only
    state = ProtocolState.from_state_dict(saved)   # also reads a previous release's checkpoint
    policy = resume_policy(state, config)          # a joiner; a relaunch names its replicas

`state_dict()` holds plain Python values only (ints, floats, strings, None, lists, tuples and
dicts): a torch_dist checkpoint's common state is read with `torch.load(weights_only=True)`,
which refuses any other class, so the layout and the speed history go as dicts of their fields.

Layer 2 may import the policy (layer 3: pure Python, it imports nothing of this package's
layers); this module imports nothing else of the package.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Iterable, Mapping

from megatron_recover.policy import ADAPTIVE, IdSet, Layout, PolicyConfig, WorkloadPolicy
from megatron_recover.policy import advance_layout
from megatron_recover.policy.adaptive import AdaptiveLayout
from megatron_recover.policy.speed import SpeedState, Streaks


@dataclass(frozen=True)
class ProtocolState:
    """The recovery protocol's state after a committed iteration (see the module docstring).

    Equal on every live rank of a run at the same iteration, except `replica_of_rank`, which
    names the members of the capturing rank's cross-replica group (a position's)."""

    iteration: int
    """The last iteration whose state this is: training continues with `iteration + 1`."""
    b: int
    """B, microbatches per iteration after any ramp-up (W_init x G_init)."""
    w_init: int
    """Replicas at launch: replica ids are 0..w_init-1, a relaunch runs at most that many."""
    g_init: int
    """Microbatches of a replica per iteration at launch."""
    policy: str
    """--recover-policy: "static" or "adaptive"."""
    mode: str
    """--recover-mode: "exact" or "reserve"."""
    layout: Layout | AdaptiveLayout
    """The policy's layout the next iteration starts from (its live replicas are original
    replica ids)."""
    reserve_next: int
    """The next unused position of the reserve stream (reserve mode; 0 otherwise)."""
    live_replicas: tuple[int, ...]
    """The layout's replicas, increasing (repeated for people: recover_state.json)."""
    ramp: tuple[int, ...] = ()
    """B of each iteration before a batch-size schedule's last step (--step-batch-size-schedule),
    iteration 1 first; empty: none."""
    last_committed: int | None = None
    """The policy's last committed iteration; None (the default) reads as `iteration`, which
    it equals at every capture (a checkpoint without protocol state starts a fresh policy at
    its iteration)."""
    dead_replicas: frozenset[int] = frozenset()
    """Replicas the trainer knows dead (not reported as new failures again); a standby that
    takes one's id removes it. Previous release: empty (its relaunch knew none either)."""
    replica_of_rank: Mapping[int, int] = field(default_factory=dict)
    """World rank -> replica id of the capturing rank's cross-replica group: a joiner (the
    same job) takes it as is; a relaunch (a new world) maps its own ranks and ignores it.
    Previous release: empty."""
    speeds: SpeedState = SpeedState()
    """The straggler history (`policy.speed.SpeedState`): each measured live replica's recent
    times and streaks, the replicas marked slow, the quotas in force. Previous release: empty
    (no history: balancing starts over, as a new run's)."""
    committed_reserve: frozenset[int] = frozenset()
    """Reserve ids (>= B) committed so far in the run: the audit refuses one committed again.
    Previous release: empty (the audit then remembers from the resumed iteration on; the
    reserve pointer alone still never hands out an id twice)."""

    def __post_init__(self):
        object.__setattr__(self, "ramp", tuple(self.ramp))
        object.__setattr__(self, "live_replicas", tuple(self.live_replicas))
        object.__setattr__(self, "dead_replicas", frozenset(self.dead_replicas))
        object.__setattr__(self, "replica_of_rank", dict(self.replica_of_rank))
        object.__setattr__(self, "committed_reserve", frozenset(self.committed_reserve))
        if self.last_committed is None:
            object.__setattr__(self, "last_committed", self.iteration)

    @classmethod
    def initial(cls, config: PolicyConfig, iteration: int = 0) -> "ProtocolState":
        """A fresh policy's state continuing after `iteration` (a checkpoint that holds no
        protocol state: Megatron-LM's, a stock run's)."""
        return cls.of_policy(WorkloadPolicy(config), iteration, last_committed=iteration)

    @classmethod
    def of_policy(cls, policy: WorkloadPolicy, iteration: int, *, dead_replicas=(),
                  replica_of_rank: Mapping[int, int] | None = None, committed_reserve=(),
                  last_committed: int | None = None) -> "ProtocolState":
        """The state of `policy` (between iterations) after `iteration`, with the trainer's
        parts given."""
        if policy.in_iteration:
            raise ValueError(f"the protocol state is captured between iterations; iteration "
                             f"{policy.iteration} is in progress")
        config = policy.config
        return cls(iteration=iteration, b=config.b, w_init=config.w_init, g_init=config.g_init,
                   policy=config.policy, mode=config.mode, layout=policy.layout,
                   reserve_next=policy.reserve_next, live_replicas=policy.layout.replicas,
                   ramp=config.ramp,
                   last_committed=(policy.last_committed if last_committed is None
                                   else last_committed),
                   dead_replicas=dead_replicas, replica_of_rank=replica_of_rank or {},
                   speeds=policy.speeds, committed_reserve=committed_reserve)

    def state_dict(self) -> dict:
        """Plain values only (`torch.load(weights_only=True)` reads them): the layout and the
        speed history as dicts of their fields, sets as sorted lists, the committed reserve
        ids as [lo, hi) spans (they come from a stream, so mostly in runs)."""
        return {
            "iteration": self.iteration, "b": self.b, "w_init": self.w_init,
            "g_init": self.g_init, "policy": self.policy, "mode": self.mode,
            "layout": asdict(self.layout), "reserve_next": self.reserve_next,
            "live_replicas": tuple(self.live_replicas), "ramp": tuple(self.ramp),
            "last_committed": self.last_committed,
            "dead_replicas": sorted(self.dead_replicas),
            "replica_of_rank": {int(r): int(i) for r, i in sorted(self.replica_of_rank.items())},
            "speeds": _speeds_dict(self.speeds),
            "committed_reserve": [list(span) for span in
                                  IdSet.of(self.committed_reserve).spans],
        }

    @classmethod
    def from_state_dict(cls, saved: Mapping) -> "ProtocolState":
        """The state `state_dict()` returned. A previous release's checkpoint (its
        `RecoveryState.to_dict()`: iteration, b, w_init, g_init, policy, mode, layout,
        reserve_next, live_replicas and ramp) loads too: each key it lacks takes its neutral
        value (the field's docstring says which). A key this release does not know is refused
        (a newer release's state, which this one would continue wrongly)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(saved) - names)
        if unknown:
            raise ValueError(f"protocol state: unknown keys {unknown} (written by a newer "
                             "megatron-recover?)")
        values = dict(saved)
        layout_type = AdaptiveLayout if values["policy"] == ADAPTIVE else Layout
        layout = dict(values["layout"])
        values["layout"] = layout_type(**{k: tuple(v) if isinstance(v, list) else v
                                          for k, v in layout.items()})
        if "speeds" in values:
            values["speeds"] = _speeds_of(values["speeds"])
        if "committed_reserve" in values:
            values["committed_reserve"] = _ids_of(values["committed_reserve"])
        if "replica_of_rank" in values:
            values["replica_of_rank"] = {int(r): int(i)
                                         for r, i in dict(values["replica_of_rank"]).items()}
        return cls(**values)

    def summary(self) -> dict:
        """recover_state.json's content, for people: the state without the layout's fields,
        each live replica's role instead, and the committed reserve ids as a count and their
        spans."""
        saved = self.state_dict()
        del saved["layout"]
        role_of = getattr(self.layout, "role_of", lambda replica: "major")  # adaptive: majors
        saved["roles"] = {str(r): role_of(r) for r in self.live_replicas}
        saved["committed_reserve_count"] = len(self.committed_reserve)
        return saved


def capture(trainer, iteration: int) -> ProtocolState:
    """The protocol state of `trainer` (a `ResilientTrainer`, between iterations) after
    `iteration`. Reads `trainer.p.policy`, `trainer.dead_replicas`, `trainer.p.replica_of_rank`
    and `trainer.p.audit.committed_reserve`."""
    return ProtocolState.of_policy(trainer.p.policy, iteration,
                                   dead_replicas=trainer.dead_replicas,
                                   replica_of_rank=trainer.p.replica_of_rank,
                                   committed_reserve=trainer.p.audit.committed_reserve)


def resume_policy(state: ProtocolState, config: PolicyConfig,
                  replicas: Iterable[int] | None = None) -> WorkloadPolicy:
    """The policy continuing `state` with this run's `config` (its launch flags: B, the
    ramp-up, policy and mode must be the state's; W_init and G_init are the state's: a relaunch
    may run fewer replicas). `replicas`: the replica ids the
    continuing run has (a relaunch's: the survivors' first, then vacant ids); None or the
    state's live replicas: its layout as saved. On other ids the static policy lays them out
    afresh (Algorithm 7; the adaptive policy refuses), and the straggler history forgets the
    ids that came or went (a replica's history is its own)."""
    if (config.b, config.ramp, config.policy, config.mode) != (state.b, state.ramp,
                                                               state.policy, state.mode):
        raise ValueError(f"the protocol state has B = {state.b}, ramp-up {list(state.ramp)}, "
                         f"policy {state.policy} in {state.mode} mode; this run B = {config.b}, "
                         f"ramp-up {list(config.ramp)}, policy {config.policy} in "
                         f"{config.mode} mode")
    config = replace(config, w_init=state.w_init, g_init=state.g_init)
    layout, speeds = state.layout, state.speeds
    live = set(state.live_replicas)
    ids = live if replicas is None else set(replicas)
    if ids != live:
        if state.policy == ADAPTIVE:
            raise ValueError(f"the adaptive policy resumes on its {len(live)} live replicas "
                             f"{sorted(live)} only, not on {sorted(ids)}")
        layout = advance_layout(ids, layout.b)
        speeds = speeds.forget(ids ^ live)
    return WorkloadPolicy.resume(config, layout, state.last_committed, state.reserve_next,
                                 speeds)


def _speeds_dict(speeds: SpeedState) -> dict:
    return {"replicas": {int(r): {"times": tuple(float(t) for t in s.times), "slow": s.slow,
                                  "within": s.within, "evictable": s.evictable}
                         for r, s in sorted(speeds.replicas.items())},
            "marked": sorted(speeds.marked),
            "quotas": {int(r): int(q) for r, q in sorted(speeds.quotas.items())}}


def _speeds_of(saved: Mapping) -> SpeedState:
    return SpeedState(
        replicas={int(r): Streaks(times=tuple(float(t) for t in s["times"]), slow=s["slow"],
                                  within=s["within"], evictable=s["evictable"])
                  for r, s in dict(saved["replicas"]).items()},
        marked=frozenset(saved["marked"]),
        quotas={int(r): int(q) for r, q in dict(saved["quotas"]).items()})


def _ids_of(spans) -> frozenset[int]:
    return frozenset(i for lo, hi in spans for i in range(lo, hi))
