"""Batch-size ramp-up in layer 3: the schedule against megatron-core's calculator, and the policies
re-laying out at each ramp step under failures.

Pure Python apart from the first test, which imports megatron-core's calculator (skipped without
it); a few seconds: `python -m pytest tests/policy/test_rampup.py -q`.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_recover.policy import (
    ADAPTIVE,
    RESERVE,
    GlobalBatches,
    PolicyConfig,
    PolicyNumMicroBatchesCalculator,
    WorkloadPolicy,
    ramp_up,
)
from tests.policy.test_policy_properties import reference_algorithm7

SETTINGS = dict(deadline=None, max_examples=300,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def megatron_batches(start, increment, ramp_samples, gbs, iterations):
    """(first sample, size) of iterations 1.. as Megatron-LM's loop sees them: megatron-core's
    calculator updated with the consumed samples before each iteration."""
    module = pytest.importorskip("megatron.core.num_microbatches_calculator",
                                 reason="megatron-core is not installed")
    calculator = module.RampupBatchsizeNumMicroBatchesCalculator(
        gbs, 1, 1, False, -1, start, increment, ramp_samples)
    batches, consumed = [], 0
    for _ in range(iterations):
        calculator.update(consumed, consistency_check=False)
        batches.append((consumed, calculator.get_current_global_batch_size()))
        consumed += batches[-1][1]
    return batches


@pytest.mark.parametrize("start, increment, ramp_samples, gbs", [
    (16, 16, 5859375 // 1000, 1536),  # the GPT-3 example's ramp, a thousandth of its samples
    (8, 8, 64, 16), (8, 8, 60, 16), (4, 4, 1, 16), (3, 5, 97, 23), (1, 1, 1000, 64)])
def test_schedule_is_megatron_cores(start, increment, ramp_samples, gbs):
    batches = GlobalBatches(gbs, ramp_up(start, increment, ramp_samples, gbs))
    iterations = len(batches.ramp) + 5
    expected = megatron_batches(start, increment, ramp_samples, gbs, iterations)
    ours = [(batches.first_sample(t), batches.size(t)) for t in range(1, iterations + 1)]
    assert ours == expected
    assert batches.ramp[0] == start and all(s == gbs for _, s in expected[len(batches.ramp):])
    # Megatron-LM's update_train_iters: the ramp phase is every iteration starting at or before
    # the ramp's samples.
    assert [first <= ramp_samples for first, _ in expected] == [
        t <= len(batches.ramp) for t in range(1, iterations + 1)]


def test_schedule_refuses_what_megatron_cannot_run():
    for args in ((0, 8, 64, 16), (8, 0, 64, 16), (8, 8, 0, 16), (16, 8, 64, 16), (8, 3, 64, 16),
                 (24, 8, 64, 16)):
        with pytest.raises(ValueError):
            ramp_up(*args)
    with pytest.raises(ValueError, match="end inside the batch-size ramp-up"):
        GlobalBatches(16, (8, 8, 16)).iterations_in(31)
    assert GlobalBatches(16, (8, 8, 16)).iterations_in(32 + 47) == 3 + 2


@st.composite
def ramped_runs(draw):
    """A config with a ramp (non-decreasing multiples of W_init up to B) and, per iteration, the
    replicas that die in its first-pass reduce (at least one replica always survives)."""
    w = draw(st.integers(1, 12))
    g = draw(st.integers(2, 8))
    steps = draw(st.lists(st.integers(1, g), min_size=1, max_size=6))
    ramp = tuple(w * k for k in sorted(steps))
    policy = draw(st.sampled_from(["static", "static-reserve", ADAPTIVE]))
    config = PolicyConfig(w, g, policy="static" if policy != ADAPTIVE else ADAPTIVE,
                          mode=RESERVE if policy == "static-reserve" else "exact", ramp=ramp)
    iterations = len(ramp) + 2
    live = list(range(w))
    deaths = []
    for _ in range(iterations):
        k = draw(st.integers(0, max(0, min(2, len(live) - 1))))
        dead = draw(st.permutations(live))[:k]
        live = [r for r in live if r not in dead]
        deaths.append(sorted(dead))
    return config, ramp, deaths


@settings(**SETTINGS)
@given(ramped_runs())
def test_every_iteration_commits_its_own_b(run):
    """The committed ids of iteration t are computed here from the ramp the test drew, not from
    the policy: static exact ids 0..B_t-1; reserve B_t distinct ids, main ones below B_t;
    adaptive the surviving replicas' slices of width B_t / W_init. A ramp step after failures
    lays the survivors out by Algorithm 7 for the new B."""
    config, ramp, deaths = run
    policy = WorkloadPolicy(config)
    alive = set(range(config.w_init))
    for t, dead in enumerate(deaths, start=1):
        b_t = ramp[t - 1] if t <= len(ramp) else config.b
        state = policy.begin(t)
        if config.policy != ADAPTIVE and t > 1 and b_t != (ramp + (config.b,))[t - 2]:
            layout = state.layout
            assert (layout.g_cur, layout.majors, layout.minor, layout.major_spares,
                    layout.minor_spares) == reference_algorithm7(alive, b_t)
        if dead:
            policy.on_failure(dead)
            alive -= set(dead)
        result = policy.commit()
        committed = result.committed.to_list()
        if config.policy == ADAPTIVE:
            g_t = b_t // config.w_init
            expected = sorted(k for r in alive for k in range(r * g_t, (r + 1) * g_t))
            assert committed == expected and result.divisor == len(expected)
        elif config.mode == RESERVE:
            assert len(committed) == b_t == result.divisor
            assert all(k < b_t or k >= config.b for k in committed)
        else:
            assert committed == list(range(b_t)) and result.divisor == b_t


def test_calculator_follows_the_ramp():
    """megatron-core's get_num_microbatches() under --recover: this data-parallel rank's share of
    the iteration's B, moving with the ramp and with the roles after a failure."""
    policy = WorkloadPolicy(PolicyConfig(4, 4, ramp=(4, 8, 8)))
    calc = PolicyNumMicroBatchesCalculator(policy, 0, micro_batch_size=2)
    shards = [PolicyNumMicroBatchesCalculator(policy, 1, 2, shard, 2) for shard in (0, 1)]
    sizes = []
    for t in range(1, 6):
        sizes.append((calc.get(), calc.get_current_global_batch_size(),
                      [s.get() for s in shards]))
        policy.begin(t)
        if t == 3:
            policy.on_failure([3])
        policy.commit()
    # B = 4, 8, 8, then 16: one, two, two, four microbatches each; replica 3 dies in iteration 3,
    # so iteration 4 (B = 16 over three replicas) gives majors 6, 6 and a minor 4 (Algorithm 7).
    assert sizes == [(1, 8, [1, 0]), (2, 16, [1, 1]), (2, 16, [1, 1]), (6, 32, [3, 3]),
                     (6, 32, [3, 3])]


def test_ramp_is_validated():
    for ramp in ((3,), (8, 4), (20,), (0,)):
        with pytest.raises(ValueError, match="ramp must be"):
            PolicyConfig(4, 4, ramp=ramp)
    assert PolicyConfig(4, 4, ramp=[4, 8]).b_at(2) == 8 and PolicyConfig(4, 4).b_at(9) == 16
