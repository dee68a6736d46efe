"""Stragglers in the static policy (`policy/speed.py`): quotas, hysteresis, moving back,
eviction, exactness under failures. Pure Python, seconds.

The quotas are checked against an optimum found independently (the smallest finish time any
quota assignment can reach, by scanning every candidate time); the committed ids against the
failure-free set 0..B-1, from the policy's own results only through what it committed.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_recover.policy import PolicyConfig, WorkloadPolicy
from megatron_recover.policy.replay import SlowReplica, simulate
from megatron_recover.policy.speed import (
    SpeedState,
    StragglerConfig,
    balanced_quotas,
    observe,
)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def optimal_makespan(b: int, times: dict[int, float]) -> float:
    """The smallest T such that quotas of at least 1 each, q_r * t_r <= T, can sum to b: T is
    some k * t_r, and T works iff every replica can take one microbatch by T and together they
    can take b."""
    candidates = sorted({k * t for t in times.values() for k in range(1, b + 1)})
    for limit in candidates:
        counts = [int(limit / t + 1e-9) for t in times.values()]
        if min(counts) >= 1 and sum(counts) >= b:
            return limit
    raise AssertionError("no feasible finish time")


@settings(max_examples=300, **SETTINGS)
@given(st.integers(1, 12).flatmap(lambda w: st.tuples(
    st.integers(w, 6 * w), st.lists(st.sampled_from([0.5, 1.0, 1.0, 1.3, 2.0, 3.0, 7.0]),
                                    min_size=w, max_size=w))))
def test_quotas_sum_to_b_one_each_and_finish_first(case):
    b, speeds = case
    times = dict(enumerate(speeds))
    quotas = balanced_quotas(b, times)
    assert sum(quotas.values()) == b and min(quotas.values()) >= 1
    finish = max(quotas[r] * times[r] for r in times)
    assert finish == pytest.approx(optimal_makespan(b, times), rel=1e-9)
    # Faster never gets fewer: quotas follow speed.
    for r in times:
        for s in times:
            if times[r] < times[s]:
                assert quotas[r] >= quotas[s], (quotas, times)


def test_no_quotas_when_b_cannot_feed_every_replica():
    assert balanced_quotas(3, {0: 1.0, 1: 1.0, 2: 2.0, 3: 1.0}) is None


def policy(w=4, g=4, threshold=0.25, window=3, evict=0.0) -> WorkloadPolicy:
    return WorkloadPolicy(PolicyConfig(w, g, straggler=StragglerConfig(threshold, window,
                                                                       evict)))


def step(p: WorkloadPolicy, times: dict[int, float], fail=()):
    state = p.begin()
    first = {r: len(w.first_pass) for r, w in state.work.items()}
    if fail:
        p.on_failure(fail)
    result = p.commit({r: t for r, t in times.items() if r in p.state.live})
    assert sorted(result.committed) == list(range(p.config.b)), "exact: ids 0..B-1 once"
    return first, result


def test_a_single_slow_iteration_moves_nothing():
    p = policy(window=3)
    for t in range(1, 12):
        times = {r: 1.0 for r in range(4)}
        if t in (3, 6, 7):  # a spike, then two in a row: below the window of three
            times[1] = 5.0
        first, result = step(p, times)
        assert first == {r: 4 for r in range(4)} and not result.slow, t


def test_work_moves_within_the_window_and_back_when_speed_recovers():
    p = policy(window=3)
    firsts = []
    for t in range(1, 16):
        times = {r: 1.0 for r in range(4)}
        if 3 <= t <= 8:
            times[2] = 2.0
        first, _ = step(p, times)
        firsts.append(first[2])
    # Slow from 3: slow for 3, 4, 5, so the layout of 6 moves work (2 x 2 = 4 <= 5, the
    # others' 14 over three); back within from 9: within for 9, 10, 11, so 12 is plain again.
    assert firsts == [4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4], firsts


def test_quotas_follow_speed_after_a_failure_and_ids_stay_exact():
    p = policy(w=4, g=4, window=2)
    seen = []
    for t in range(1, 9):
        times = {r: (4.0 if r == 2 and t >= 2 else 1.0) for r in range(4)}
        first, result = step(p, times, fail=[3] if t == 5 else ())
        seen.append(first)
    assert seen[3] == {0: 5, 1: 5, 2: 1, 3: 5}  # after slow 2, 3: balanced from 4
    assert seen[6] == {0: 8, 1: 7, 2: 1}  # three left, still balanced: finish 8 (1 x 4 <= 8)


def test_eviction_after_a_window_past_the_factor():
    p = policy(w=4, g=2, threshold=0.25, window=2, evict=3.0)
    evicted = []
    for t in range(1, 7):
        times = {r: 1.0 for r in p.layout.replicas}
        if 2 in times and t >= 3:
            times[2] = 4.0
        _, result = step(p, times)
        evicted.append(sorted(result.evicted))
    assert evicted == [[], [], [], [2], [], []]
    assert p.layout.replicas == (0, 1, 3)


def test_slower_but_below_the_factor_is_balanced_not_evicted():
    reports = simulate(PolicyConfig(4, 4, straggler=StragglerConfig(0.25, 2, 3.0)), 8,
                       slow=[SlowReplica(1, 2.5, 2)])
    assert all(not r.result.evicted for r in reports)
    assert dict(reports[-1].first_pass)[1] < 4


def test_of_two_replicas_only_the_slower_is_evicted():
    config = StragglerConfig(0.1, 2, 2.0)
    state = SpeedState()
    for _ in range(2):
        state, decision = observe(config, state, {0: 1.0, 1: 10.0}, [0, 1], 8)
    assert decision.evict == frozenset({1})


@settings(max_examples=150, **SETTINGS)
@given(st.integers(2, 8), st.integers(1, 6), st.data())
def test_random_speeds_and_failures_commit_b_each_id_once(w, g, data):
    """Whatever the speeds and failures, every iteration commits the ids 0..B-1, each once, and
    the first pass gives every contributing replica at least one microbatch."""
    p = policy(w=w, g=g, threshold=0.2, window=2, evict=4.0)
    for t in range(1, 10):
        live = list(p.layout.replicas)
        times = {r: data.draw(st.sampled_from([1.0, 1.1, 2.0, 5.0])) for r in live}
        fail = ()
        if len(live) > 1 and data.draw(st.integers(0, 4)) == 0:
            fail = (data.draw(st.sampled_from(live)),)
        first, result = step(p, times, fail)
        if p.config.b >= len(live) and result.slow:
            assert min(first.values()) >= 1
        assert set(p.layout.replicas) <= set(live) and not result.evicted & set(p.layout.replicas)


def test_noise_between_healthy_replicas_moves_no_work():
    """Replicas 0, 1 and 3 differ by less than the threshold (noise, a shared host): once
    replica 2 is marked, they count as equally fast and get equal quotas; only replica 2's own
    time moves work."""
    p = policy(w=4, g=4, threshold=0.25, window=2)
    for _ in range(3):
        first, _ = step(p, {0: 1.0, 1: 0.85, 2: 4.0, 3: 1.1})
    assert first == {0: 5, 1: 5, 2: 1, 3: 5}
