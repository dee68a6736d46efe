"""The paper's appendix E walk-through (W_init=32, G_init=8, B=256), number for number.

Pure Python, no hardware: `python -m pytest tests/policy/test_policy_appendix_e.py -q`.
The paper numbers replicas r1..r32; we number them 0..31, so the paper's r32 is our 31, its
minor r29 our 28, its major-spare r30 our 29 and its minor-spare r31 our 30.
"""

from megatron_recover.policy import (
    BLOCKING,
    BOUNDARY_MINOR,
    MAJOR,
    MAJOR_SPARE,
    MINOR,
    MINOR_SPARE,
    NON_BLOCKING,
    IdSet,
    PolicyConfig,
    WorkloadPolicy,
)

B = 256


def _failure_free_iteration(policy, iteration):
    policy.begin(iteration)
    return policy.commit()


def test_appendix_e_walk_through():
    policy = WorkloadPolicy(PolicyConfig(w_init=32, g_init=8))

    # Pre-failure iterations: 32 majors at 8, C_r = 8 each, sum 256.
    pre = _failure_free_iteration(policy, 1)
    assert set(pre.roles.values()) == {MAJOR} and len(pre.roles) == 32
    assert all(len(ids) == 8 for ids in pre.per_replica_ids.values())
    assert pre.contributions == 32 * 8 == B
    assert pre.committed == IdSet.range(0, B)
    assert not pre.boundary

    # Iteration t*: r32 fails during the bucket loop, after every replica ran its 8 microbatches.
    state = policy.begin(2)
    assert all(policy.work(r).num_microbatches == 8 for r in range(32))
    decision = policy.on_failure({31})
    state = policy.state
    # C_cur = 31 * 8 = 248 (r32's contributions are dropped); at_boundary: no major-spare exists.
    assert len(state.live) == 31
    assert B - decision.pool == 248
    assert decision.boundary and decision.restore_mode == NON_BLOCKING
    # G_ext = ceil((256 - 248) / 31) = 1; overshoot 248 + 31 - 256 = 23 boundary minors.
    assert decision.g_ext == 1
    assert decision.num_boundary_minor == 23
    assert decision.promotions == ()
    # P(major) grows from 8 to 9; P(boundary-minor) stays at 8 (plus one zeroed microbatch).
    majors = [r for r in state.live if policy.work(r).role == MAJOR]
    boundary_minors = [r for r in state.live if policy.work(r).role == BOUNDARY_MINOR]
    assert len(majors) == 8 and len(boundary_minors) == 23
    for r in majors:
        work = policy.work(r)
        assert len(work.contributed) == 9 and work.extension_microbatches == 1
        assert work.extension_padding == 0
    for r in boundary_minors:
        work = policy.work(r)
        assert len(work.contributed) == 8 and work.extension_microbatches == 1
        assert len(work.extension) == 0 and work.extension_padding == 1
    # The 8 recomputed microbatches are exactly r32's.
    recomputed = IdSet.union_all(policy.work(r).extension for r in majors)
    assert recomputed == IdSet.range(31 * 8, 32 * 8)

    boundary = policy.commit()
    # Sum C_r(t*) = 31*8 + 8*1 + 23*0 = 256; 8 replicas at 9, 23 at 8 (Figure 5, panel ii).
    counts = sorted(len(ids) for ids in boundary.per_replica_ids.values())
    assert counts == [8] * 23 + [9] * 8
    assert boundary.contributions == 248 + 8 + 0 == B
    assert boundary.committed == IdSet.range(0, B)
    assert boundary.extra_microbatches == 1
    # Every survivor ran microbatch 9 (the boundary minors zero theirs).
    assert set(boundary.ran.values()) == {9}
    assert 31 not in boundary.roles

    # Post-boundary steady state (Algorithm 7 with W_cur=31, B=256): G_cur=9, n_maj=28,
    # R_cur=4, n_min=1, one major-spare and one minor-spare (Figure 5, panel iii).
    layout = boundary.next_layout
    assert layout.g_cur == 9 and len(layout.majors) == 28
    assert layout.r_cur == 256 - 28 * 9 == 4 and layout.minor == 28
    assert layout.major_spares == (29,) and layout.minor_spares == (30,)
    steady = _failure_free_iteration(policy, 3)
    assert steady.grad_accum == 9
    assert [steady.roles[r] for r in (27, 28, 29, 30)] == [MAJOR, MINOR, MAJOR_SPARE, MINOR_SPARE]
    assert steady.contributions == 28 * 9 + 1 * 4 + 1 * 0 + 1 * 0 == B
    assert steady.per_replica_ids[29] == IdSet() and steady.per_replica_ids[30] == IdSet()
    # Spares run their full forward and backward: the shadow's ids.
    assert steady.ran[29] == 9 and steady.ran[30] == 4

    # Next failure, spare available (panel iv): the minor r29 fails, the minor-spare r31 is
    # promoted by restoring its gradients; no extension, P(major) unchanged.
    policy.begin(4)
    shadow_ids = policy.work(30).first_pass
    assert shadow_ids == policy.work(28).first_pass == IdSet.range(252, 256)
    assert not policy.work(30).contributes_first_pass
    decision = policy.on_failure([28])
    assert decision.restore_mode == BLOCKING and not decision.boundary
    assert decision.promotions == ((28, 30),)
    assert policy.work(30).role == MINOR and policy.work(30).contributed == shadow_ids
    absorbed = policy.commit()
    assert absorbed.contributions == B and absorbed.committed == IdSet.range(0, B)
    assert not absorbed.boundary and absorbed.grad_accum == 9
    assert absorbed.next_layout.minor == 30 and absorbed.next_layout.minor_spares == ()
