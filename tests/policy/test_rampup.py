"""Batch-size schedules (--step-batch-size-schedule) in layer 3: the global batches against
megatron-core 0.19's StepBatchsizeNumMicroBatchesCalculator over many random schedules, and the
policies re-laying out at each schedule step under failures.

Pure Python apart from the tests that import megatron-core's calculator (skipped without it); a
few seconds: `python -m pytest tests/policy/test_rampup.py -q`.
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
    parse_step_schedule,
)
from megatron_recover.policy.rampup import MAX_RAMP_ITERATIONS
from tests.policy.test_policy_properties import reference_algorithm7

SETTINGS = dict(deadline=None, max_examples=300,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _calculator_module():
    return pytest.importorskip("megatron.core.num_microbatches_calculator",
                               reason="megatron-core is not installed")


def megatron_calculator(schedule, seq_length):
    """megatron-core's own calculator of `schedule` (data-parallel size and micro-batch size 1:
    only the global batch sizes are read)."""
    return _calculator_module().StepBatchsizeNumMicroBatchesCalculator(
        1, 1, False, -1, schedule, seq_length)


def megatron_batches(schedule, seq_length, iterations):
    """(first sample, size) of iterations 1.. as Megatron-LM's loop sees them: megatron-core's
    calculator updated with the consumed samples before each iteration."""
    calculator = megatron_calculator(schedule, seq_length)
    batches, consumed = [], 0
    for _ in range(iterations):
        calculator.update(consumed, consistency_check=False)
        batches.append((consumed, calculator.get_current_global_batch_size()))
        consumed += batches[-1][1]
    return batches


def megatron_train_iters(schedule, seq_length, train_samples):
    """Megatron-LM core_v0.19.0's update_train_iters with a step schedule, on megatron-core's
    calculator."""
    calculator = megatron_calculator(schedule, seq_length)
    iterations = consumed = 0
    while consumed < train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    return iterations


def _last_threshold(schedule, seq_length):
    return megatron_calculator(schedule, seq_length).schedule[-1][0]


def assert_matches_megatron(schedule, seq_length):
    """Our global batches of `schedule` are megatron-core's, iteration by iteration, up to 5
    iterations past the one that reaches the last step (then constant in both); or, where
    megatron-core's sizes decrease, we refuse the schedule."""
    last = _last_threshold(schedule, seq_length)
    calculator = megatron_calculator(schedule, seq_length)
    expected, consumed = [], 0
    while not expected or expected[-1][0] < last or len(expected) < 5:
        calculator.update(consumed, consistency_check=False)
        expected.append((consumed, calculator.get_current_global_batch_size()))
        consumed += expected[-1][1]
    expected += [(consumed + i * expected[-1][1], expected[-1][1]) for i in range(5)]
    sizes = [size for _, size in expected]
    if sizes != sorted(sizes):
        with pytest.raises(ValueError, match="global batch size decreases"):
            GlobalBatches.of_schedule(schedule, seq_length)
        return None
    batches = GlobalBatches.of_schedule(schedule, seq_length)
    ours = [(batches.first_sample(t), batches.size(t)) for t in range(1, len(expected) + 1)]
    assert ours == expected
    assert batches.global_batch_size == sizes[-1] and batches.stepped
    # The ramp is every iteration before the last step's size holds for good.
    assert all(size < sizes[-1] for size in batches.ramp)
    assert batches.sizes == tuple(sorted(set(sizes)))
    return batches


@pytest.mark.parametrize("schedule, seq_length", [
    ("0:768 250B:1536 500B:3072 750B:6144", 4096),  # megatron-core's docstring example
    ("0:768 61035156:1536 122070312:3072 183105468:6144", None),  # the same in samples
    ("0:4 261:8 0.52K:12 896:16", 32),  # tests/test_rampup.py's: 4, 4, 8, 12, 16, ...
    ("896:16,0:4 , 0.52K:12 261:8", 32),  # the same, unsorted, with commas
    ("0:16", 2048), ("0:8 1:16", 1), ("0:8 10:16 12:32", None),  # 16 is never used
    ("0:2 1k:4 1.5K:6 2K:8", 3), ("0:1 10:1 20:3", None)])
def test_schedule_is_megatron_cores(schedule, seq_length):
    assert assert_matches_megatron(schedule, seq_length) is not None


@st.composite
def schedules(draw, decreasing=False):
    """A schedule string megatron-core accepts: thresholds drawn in samples and written in
    tokens (or samples, without a sequence length) with a remainder the floor division drops,
    sometimes with a K suffix, entries shuffled and separated by spaces or commas; sizes
    non-decreasing, or with `decreasing` half of the time."""
    seq_length = draw(st.sampled_from([None, 1, 3, 32, 2048]))
    count = draw(st.integers(1, 6))
    thresholds = [0] + sorted(draw(st.sets(st.integers(1, 400), min_size=count - 1,
                                          max_size=count - 1)))
    sizes = draw(st.lists(st.integers(1, 64), min_size=count, max_size=count))
    if not decreasing or draw(st.booleans()):  # half of them may decrease
        sizes.sort()
    entries = []
    for threshold, size in zip(thresholds, sizes):
        value = threshold if seq_length is None else (
            threshold * seq_length + draw(st.integers(0, seq_length - 1)))
        text = str(value)
        if value and value % 1000 == 0 and draw(st.booleans()):
            text = f"{value // 1000}{draw(st.sampled_from(['K', 'k']))}"
        entries.append(f"{text}:{size}")
    entries = draw(st.permutations(entries))
    separator = draw(st.sampled_from([" ", ",", " , ", "  "]))
    return separator.join(entries), seq_length


@settings(**SETTINGS)
@given(schedules(decreasing=True))
def test_random_schedules_are_megatron_cores(drawn):
    """Any schedule megatron-core accepts: the same steps parsed, and the same global batch in
    every iteration (refused here only where megatron-core's sizes decrease)."""
    schedule, seq_length = drawn
    assert list(parse_step_schedule(schedule, seq_length)) == \
        megatron_calculator(schedule, seq_length).schedule
    assert_matches_megatron(schedule, seq_length)


@settings(**SETTINGS)
@given(schedules(), st.integers(1, 3000))
def test_train_samples_give_megatron_lms_iterations(drawn, train_samples):
    """--train-samples -> --train-iters as Megatron-LM core_v0.19.0's update_train_iters: the
    iterations that start before train_samples are consumed (the last may run past them)."""
    schedule, seq_length = drawn
    batches = GlobalBatches.of_schedule(schedule, seq_length)
    iterations = batches.iterations_in(train_samples)
    assert iterations == megatron_train_iters(schedule, seq_length, train_samples)
    assert batches.first_sample(iterations) < train_samples <= batches.consumed_after(iterations)


def test_a_constant_batch_trains_its_whole_batches():
    """Without a schedule Megatron-LM trains train_samples // global batch size iterations."""
    for samples in (16, 31, 32, 47, 100):
        assert GlobalBatches.of(16).iterations_in(samples) == samples // 16
    # A one-step schedule of the same size runs a partial last batch whole, as Megatron-LM.
    assert GlobalBatches.of_schedule("0:16", None).iterations_in(47) == 3


@pytest.mark.parametrize("schedule", [
    "", " , ", "0:8 100", "0:8 abc:16", "0:8 100:x", "0:8 inf:16", "0:8 nan:16", "40:8",
    "1K:8 64:4", "0:8 0:16", "0:8 100:16 100:32", "0:0", "0:8 100:-16", "-5:8 0:8"])
def test_schedules_megatron_core_refuses_are_refused_with_its_message(schedule):
    """A schedule megatron-core's calculator refuses (ValueError or an assertion) is a
    ValueError here, with megatron-core's message where it has one."""
    module = _calculator_module()
    with pytest.raises((ValueError, AssertionError, OverflowError)) as theirs:
        module.StepBatchsizeNumMicroBatchesCalculator(1, 1, False, -1, schedule, 32)
    with pytest.raises(ValueError) as ours:
        parse_step_schedule(schedule, 32)
    message = str(theirs.value)
    if isinstance(theirs.value, AssertionError) or message.startswith("Invalid schedule"):
        assert str(ours.value) == message
    else:  # a number float() refuses: its message, after the entry's
        assert str(ours.value).endswith(message)


def test_tokens_become_samples_by_floor_division():
    assert parse_step_schedule("0:4 63:8 64:16 1.5K:32", 32) == (
        (0, 4), (1, 8), (2, 16), (46, 32))
    with pytest.raises(ValueError, match="strictly increasing, got 0 before 0"):
        parse_step_schedule("0:4 31:8", 32)  # 31 tokens: sample 0 again


def test_what_the_policy_cannot_lay_out_is_refused():
    with pytest.raises(ValueError, match="decreases from 16 to 8 at 64 samples"):
        GlobalBatches.of_schedule("0:16 64:8", None)
    # A step no iteration starts in does not count.
    assert GlobalBatches.of_schedule("0:8 10:4 16:16", None).sizes == (8, 16)
    with pytest.raises(ValueError, match=f"more than {MAX_RAMP_ITERATIONS:,} iterations"):
        GlobalBatches.of_schedule("0:1 1T:2", None)


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
