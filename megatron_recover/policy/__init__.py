"""Layer 3: the versatile-workload policy and exact microbatch assignment. Pure Python.

No torch, no MPI: every function here is a deterministic function of the launch configuration and
the agreed failure records, so each survivor computes the same roles and ids on its own, and the
whole layer can be tested exhaustively.

Files, in reading order:
  idset.py      IdSet: microbatch ids as sorted intervals (cheap for B up to thousands)
  layout.py     roles, PolicyConfig, the steady-state Layout, Algorithm 7 (advance_layout)
  decisions.py  ReplicaWork, IterationState, PolicyDecision, IterationResult, RankWork
  static.py     the static policy: promotions, pool, extension rounds (Algorithm 6), commit
  adaptive.py   the adaptive policy: drop-and-go (Algorithm 8), the comparison baseline
  speed.py      stragglers: quotas by measured speed, hysteresis, eviction (StragglerConfig)
  workload.py   WorkloadPolicy (what the glue holds) and the megatron-style microbatch calculator
  rampup.py     batch-size schedules: the global batch of every iteration (GlobalBatches,
                parse_step_schedule)
  replay.py     simulate a run under a failure schedule and slowdowns (FailureEvent, SlowReplica)
  plan_cli.py   `megatron-recover plan`
"""

from megatron_recover.policy.idset import IdSet
from megatron_recover.policy.layout import (
    ADAPTIVE,
    BOUNDARY_MINOR,
    EXACT,
    MAJOR,
    MAJOR_SPARE,
    MINOR,
    MINOR_SPARE,
    RESERVE,
    ROLES,
    STATIC,
    Layout,
    PolicyConfig,
    advance_layout,
    initial_layout,
)
from megatron_recover.policy.decisions import (
    BLOCKING,
    NON_BLOCKING,
    IterationResult,
    IterationState,
    NoSurvivorsError,
    PolicyDecision,
    RankWork,
    ReplicaWork,
    rank_work,
)
from megatron_recover.policy.rampup import GlobalBatches, parse_step_schedule
from megatron_recover.policy.replay import FailureEvent, IterationReport, parse_failure, simulate
from megatron_recover.policy.workload import PolicyNumMicroBatchesCalculator, WorkloadPolicy

__all__ = [
    "ADAPTIVE",
    "BLOCKING",
    "BOUNDARY_MINOR",
    "EXACT",
    "MAJOR",
    "MAJOR_SPARE",
    "MINOR",
    "MINOR_SPARE",
    "NON_BLOCKING",
    "RESERVE",
    "ROLES",
    "STATIC",
    "FailureEvent",
    "GlobalBatches",
    "IdSet",
    "IterationReport",
    "IterationResult",
    "IterationState",
    "Layout",
    "NoSurvivorsError",
    "PolicyConfig",
    "PolicyDecision",
    "PolicyNumMicroBatchesCalculator",
    "RankWork",
    "ReplicaWork",
    "WorkloadPolicy",
    "advance_layout",
    "initial_layout",
    "parse_failure",
    "parse_step_schedule",
    "rank_work",
    "simulate",
]
