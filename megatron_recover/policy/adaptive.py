"""The adaptive policy: the paper's Algorithm 8, drop-and-go, kept as the comparison baseline.

Every replica is a major at G_init for the whole run and keeps its own id range
[r*G_init, (r+1)*G_init), its slice of the global batch (during a batch-size ramp-up, G is the
iteration's B / W_init). A failure never adds work: there are no
spares and no extension pass; a dead replica's uncommitted ids are dropped (and its slice stays
dropped in later iterations), the iteration commits what the survivors hold, and the gradient is
divided by that committed count, as drop-and-go systems do. The batch shrinks with the world.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_recover.policy.idset import IdSet
from megatron_recover.policy.layout import MAJOR, PolicyConfig
from megatron_recover.policy.decisions import (
    BLOCKING,
    IterationResult,
    IterationState,
    PolicyDecision,
    ReplicaWork,
    check_failed,
    commit_maps,
)

__all__ = [
    "AdaptiveLayout",
    "initial_layout",
    "begin_iteration",
    "apply_failure",
    "commit_iteration",
    "without",
]


@dataclass(frozen=True)
class AdaptiveLayout:
    """The drop-and-go layout: the live replicas, each a major at g_cur = G_init."""

    g_cur: int
    replicas: tuple[int, ...]

    @property
    def r_cur(self) -> int:
        """Drop-and-go has no minor."""
        return 0

    def first_pass_ids(self, replica: int) -> IdSet:
        """A replica's own slice of the global batch, fixed for the whole run."""
        if replica not in self.replicas:
            raise ValueError(f"replica {replica} is not part of this layout")
        return IdSet.range(replica * self.g_cur, (replica + 1) * self.g_cur)


def initial_layout(config: PolicyConfig) -> AdaptiveLayout:
    """All W_init replicas, majors at iteration 1's B / W_init (G_init without a ramp-up)."""
    return AdaptiveLayout(g_cur=config.b_at(1) // config.w_init,
                          replicas=tuple(range(config.w_init)))


def begin_iteration(
    config: PolicyConfig, layout: AdaptiveLayout, iteration: int, reserve_next: int = 0
) -> IterationState:
    """Every live replica runs and contributes its own slice (no reserve stream: reserve_next is
    carried unchanged). A batch-size ramp-up step widens every slice to the iteration's
    B / W_init; a dead replica's slice stays dropped."""
    g_cur = config.b_at(iteration) // config.w_init
    if layout.g_cur != g_cur:
        layout = replace(layout, g_cur=g_cur)
    work = {
        r: ReplicaWork(r, MAJOR, r, layout.first_pass_ids(r), True) for r in layout.replicas
    }
    return IterationState(
        config=config, iteration=iteration, layout=layout, work=work, reserve_next=reserve_next
    )


def apply_failure(state: IterationState, failed) -> tuple[IterationState, PolicyDecision]:
    """Algorithm 8: drop the dead replicas' ids; always a blocking restore, never a boundary."""
    failed = check_failed(state, failed)
    dropped = sum(len(state.work[r].held) for r in failed)
    work = {r: w for r, w in state.work.items() if r not in failed}
    new_state = replace(state, work=work, failed=state.failed | failed)
    return new_state, PolicyDecision(BLOCKING, dropped=dropped)


def without(layout: AdaptiveLayout, failed: set[int]) -> AdaptiveLayout:
    """Replicas that died between iterations: their slices are dropped from then on."""
    return AdaptiveLayout(g_cur=layout.g_cur,
                          replicas=tuple(r for r in layout.replicas if r not in failed))


def with_replicas(layout: AdaptiveLayout, joined: set[int]) -> AdaptiveLayout:
    """Replicas that came back between iterations (standbys took their ids): each runs its own
    slice again, so the committed batch grows back by their slices."""
    return AdaptiveLayout(g_cur=layout.g_cur, replicas=tuple(sorted({*layout.replicas, *joined})))


def commit_iteration(state: IterationState) -> IterationResult:
    """Commit what the survivors hold; the divisor is that committed count."""
    maps = commit_maps(state)
    return IterationResult(
        iteration=state.iteration,
        grad_accum=state.layout.g_cur,
        minor_microbatches=0,
        divisor=len(maps["committed"]),
        extension_rounds=(),
        promotions=(),
        failed=state.failed,
        next_layout=AdaptiveLayout(g_cur=state.layout.g_cur, replicas=state.live),
        next_reserve=state.reserve_next,
        **maps,
    )
