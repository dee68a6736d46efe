"""The static policy: the paper's Algorithms 6 and 7, in exact or reserve mode.

An iteration goes: `begin_iteration` (first pass from the layout), then `apply_failure` once per
agreed failure record, then `commit_iteration`. On a record, in increasing replica id:

1. A dead replica that held no ids (an unpromoted spare, or a boundary minor with nothing to
   contribute) costs nothing.
2. In the first pass, a dead contributing replica is replaced by promoting a live spare: exact mode
   its own shadow (a spare of the same slot), reserve mode any spare of its role (the lowest id).
   The spare already ran the work, so nothing is recomputed (blocking restore).
3. Every other dead replica's uncommitted ids form the pool. Exact mode recomputes those very ids;
   reserve mode drops them and draws as many fresh ids from the reserve stream.
4. A non-empty pool is a policy boundary (Algorithm 6): G_ext is the smallest integer with
   C_cur + W_cur*G_ext >= B, and all live replicas share the pool in a new extension round
   (non-blocking restore).

Extension recursion. A failure during an extension pass is the same step again: the dead
replica's ids are *all* uncommitted (nothing commits before the final reduce), so its first-pass
and extension ids together go back to the pool, C_cur is what the survivors now hold, and a further
round with its own G_ext follows. Every round strictly shrinks the live set, so the recursion ends
after at most W_init - 1 rounds. Promotions happen only in the first pass: at a policy boundary the
spares' shadow gradients are discarded (they hold duplicates in exact mode) and the spares become
ordinary extension workers.

After a boundary iteration commits, the next layout is Algorithm 7 over the survivors; after any
other iteration the layout carries over, promoted spares now in their new roles.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_recover.policy.idset import IdSet
from megatron_recover.policy.layout import (
    EXACT,
    MAJOR,
    MAJOR_SPARE,
    MINOR,
    MINOR_SPARE,
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
    PolicyDecision,
    ReplicaWork,
    check_failed,
    commit_maps,
)

__all__ = ["initial_layout", "begin_iteration", "apply_failure", "commit_iteration", "without",
           "with_replicas"]


def begin_iteration(
    config: PolicyConfig, layout: Layout, iteration: int, reserve_next: int = 0
) -> IterationState:
    """The first-pass assignment of `iteration` under `layout`.

    Majors and the minor run their slot's ids; exact-mode spares run the ids of the slot they
    shadow; reserve-mode spares run fresh reserve-stream ids (id B + j is the j-th microbatch of the
    run's reserve stream), starting at reserve index `reserve_next`. An iteration whose B differs
    from the layout's (a batch-size ramp-up step) first re-lays out the live replicas for its B
    by Algorithm 7, so that the ids 0..B-1 of the new B are shared as a boundary would share them.
    """
    b = config.b_at(iteration)
    if layout.b != b:
        layout = advance_layout(layout.replicas, b)
    work: dict[int, ReplicaWork] = {}
    for replica in layout.replicas:
        role = layout.role_of(replica)
        slot = layout.slot_of(replica)
        ids = layout.slot_ids(slot)
        if role in (MAJOR, MINOR) or config.mode == EXACT:
            work[replica] = ReplicaWork(replica, role, slot, ids, role in (MAJOR, MINOR))
            continue
        reserve_ids = IdSet.range(config.b + reserve_next, config.b + reserve_next + len(ids))
        reserve_next += len(ids)
        work[replica] = ReplicaWork(replica, role, None, reserve_ids, False)
    return IterationState(
        config=config, iteration=iteration, layout=layout, work=work, reserve_next=reserve_next
    )


def apply_failure(state: IterationState, failed) -> tuple[IterationState, PolicyDecision]:
    """Algorithm 6 (POLICY_ADJUSTMENT) for one agreed failure record.

    `failed` is the set of replicas the consensus reported dead since the last record. Returns the
    new state (promotions made, a new extension round if the pool is not empty) and the decision
    the recovery layer acts on. Raises ValueError if a named replica is not live and
    NoSurvivorsError if none would be left.
    """
    failed = check_failed(state, failed)
    work = {r: w for r, w in state.work.items() if r not in failed}
    promotions: list[tuple[int, int]] = []
    lost: list[IdSet] = []
    for dead in sorted(failed):
        dead_work = state.work[dead]
        if not dead_work.held:
            continue
        spare = _promotable_spare(state, work, dead_work)
        if spare is None:
            lost.append(dead_work.held)
            continue
        work[spare] = _promote(work[spare], dead_work, state.config.mode)
        promotions.append((dead, spare))

    pool, reserve_next = _pool(state, lost)
    new_state = replace(
        state,
        work=work,
        failed=state.failed | failed,
        promotions=state.promotions + tuple(promotions),
        reserve_next=reserve_next,
    )
    if not pool:
        return new_state, PolicyDecision(BLOCKING, promotions=tuple(promotions))
    assert new_state.contributions() + len(pool) == state.b, "pool must make up B"
    new_state, g_ext, n_bdry = _extension_round(new_state, pool)
    decision = PolicyDecision(
        NON_BLOCKING,
        g_ext=g_ext,
        num_boundary_minor=n_bdry,
        promotions=tuple(promotions),
        pool=len(pool),
    )
    return new_state, decision


def commit_iteration(state: IterationState) -> IterationResult:
    """Close the iteration: what it committed, and the layout of the next one.

    The next layout is Algorithm 7 over the survivors after a boundary iteration, the carried-over
    layout (with promotions applied) otherwise.
    """
    maps = commit_maps(state)
    assert len(maps["committed"]) == state.b, "the static policy commits exactly B ids"
    if state.boundary:
        next_layout = advance_layout(state.live, state.b)
    else:
        next_layout = _carry_layout(state)
    return IterationResult(
        iteration=state.iteration,
        grad_accum=state.layout.g_cur,
        minor_microbatches=state.layout.r_cur,
        divisor=state.b,
        extension_rounds=state.rounds,
        promotions=state.promotions,
        failed=state.failed,
        next_layout=next_layout,
        next_reserve=state.reserve_next,
        **maps,
    )


def without(layout: Layout, failed: set[int]) -> Layout:
    """The layout after replicas died between iterations: Algorithm 7 over the survivors, the
    layout a boundary iteration would have left (no work was in flight, so nothing to recover)."""
    return advance_layout([r for r in layout.replicas if r not in failed], layout.b)


def with_replicas(layout: Layout, joined: set[int]) -> Layout:
    """The layout after replicas `joined` came back between iterations (standbys took their
    ids): Algorithm 7 over the grown set, B unchanged, so per-replica work goes down."""
    return advance_layout([*layout.replicas, *joined], layout.b)


def _promotable_spare(state: IterationState, work, dead_work: ReplicaWork) -> int | None:
    """The live spare that takes over `dead_work`'s slot, or None.

    Only in the first pass: after a boundary the spares' first-pass gradients are gone. Exact
    mode: the lowest live spare shadowing the same slot (its ids are the dead replica's). Reserve
    mode: the lowest live spare of the dead replica's role (same microbatch count).
    """
    if state.round > 0:
        return None
    wanted = MAJOR_SPARE if dead_work.base_role == MAJOR else MINOR_SPARE
    for replica in sorted(work):
        candidate = work[replica]
        if candidate.base_role != wanted:
            continue
        if state.config.mode == EXACT and candidate.slot != dead_work.slot:
            continue
        return replica
    return None


def _promote(spare: ReplicaWork, dead: ReplicaWork, mode: str) -> ReplicaWork:
    """`spare` takes `dead`'s role and slot; its first-pass work now contributes."""
    if mode == EXACT:
        assert spare.first_pass == dead.held, "a shadow runs exactly its slot's ids"
    else:
        assert len(spare.first_pass) == len(dead.held), "a spare of the role runs as many ids"
    return replace(spare, base_role=dead.base_role, slot=dead.slot, contributes_first_pass=True)


def _pool(state: IterationState, lost: list[IdSet]) -> tuple[IdSet, int]:
    """The ids to share in an extension round, and the reserve cursor after drawing them.

    Exact mode recomputes the lost ids themselves; reserve mode drops them and draws the same
    number of fresh ids from the reserve stream.
    """
    lost_ids = IdSet.union_all(lost)
    if state.config.mode == EXACT or not lost_ids:
        return lost_ids, state.reserve_next
    start = state.config.b + state.reserve_next
    return IdSet.range(start, start + len(lost_ids)), state.reserve_next + len(lost_ids)


def _extension_round(state: IterationState, pool: IdSet) -> tuple[IterationState, int, int]:
    """Share `pool` among all live replicas in a new extension round (Algorithm 6, lines 7-9).

    G_ext = ceil(|pool| / W_cur), the smallest integer with C_cur + W_cur*G_ext >= B;
    n_bdry = W_cur*G_ext - |pool| replicas are boundary minors (G_ext - 1 ids plus one padding
    microbatch), the others take G_ext ids. Replicas that have run the least so far take the full
    G_ext (ties by replica id), which keeps the slowest replica's total as short as it can be; the
    pool goes out in increasing id, in that order.
    """
    live = state.live
    w_cur = len(live)
    g_ext = -(-len(pool) // w_cur)
    n_bdry = w_cur * g_ext - len(pool)
    order = sorted(live, key=lambda r: (state.work[r].ran_count, r))
    work = dict(state.work)
    rest = pool
    for position, replica in enumerate(order):
        is_boundary_minor = position >= w_cur - n_bdry
        ids, rest = rest.take(g_ext - 1 if is_boundary_minor else g_ext)
        old = work[replica]
        assert len(old.extension) == state.round, "every live replica takes part in every round"
        work[replica] = replace(
            old,
            extension=old.extension + (ids,),
            padding=old.padding + (1 if is_boundary_minor else 0),
            boundary_minor=is_boundary_minor,
        )
    assert not rest, "the pool is shared out completely"
    return replace(state, work=work, rounds=state.rounds + (g_ext,)), g_ext, n_bdry


def _carry_layout(state: IterationState) -> Layout:
    """The layout after a non-boundary iteration: same G_cur and R_cur, promoted spares in place.

    Every slot is still held (otherwise the pool would have been non-empty); majors are re-sorted
    into replica order, which is what fixes their id ranges in the next iteration. A balanced
    layout has no spares, so nothing was promoted: it carries over as it is.
    """
    if state.layout.quotas:
        return state.layout
    by_role: dict[str, list[int]] = {MAJOR: [], MINOR: [], MAJOR_SPARE: [], MINOR_SPARE: []}
    for replica in state.live:
        by_role[state.work[replica].base_role].append(replica)
    assert len(by_role[MINOR]) <= 1
    return Layout(
        b=state.b,
        g_cur=state.layout.g_cur,
        r_cur=state.layout.r_cur,
        majors=tuple(by_role[MAJOR]),
        minor=by_role[MINOR][0] if by_role[MINOR] else None,
        major_spares=tuple(by_role[MAJOR_SPARE]),
        minor_spares=tuple(by_role[MINOR_SPARE]),
    )
