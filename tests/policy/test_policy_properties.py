"""Property tests of the policies under random failure schedules (hypothesis).

Pure Python, no hardware; about two minutes on two slow cores:
`python -m pytest tests/policy/test_policy_properties.py -q`. Each test runs its generated cases,
then asserts minimum counts per scenario class, so trivial cases cannot carry the run; the case and
scenario counts are printed in pytest's terminal summary (see conftest.py).

A case draws W_init in 1..64 and G_init in 1..128 (B up to 8,192), then, iteration by iteration,
which live replicas die in the first-pass reduce, in each extension pass and after the commit:
none, one, a few, or all but one, picked among all live replicas, the contributing ones, the
spares, or the contributors a spare can replace.
"""

import collections

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

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
    advance_layout,
    rank_work,
)
from megatron_recover.policy import adaptive, static

SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

w_inits = st.integers(1, 64)
# Half the cases take G_init <= 8: Algorithm 7 leaves spares only when G_cur is small against
# W_cur (spares * G_cur < W_cur), and promotions need spares.
g_inits = st.one_of(st.integers(1, 8), st.integers(1, 128))


# ---------------------------------------------------------------------------------------------
# Reference computations, written independently of the package.


def reference_algorithm7(live, b):
    """Algorithm 7 by brute force: (G_cur, majors, minor, major_spares, minor_spares)."""
    order = sorted(live)
    g = 1
    while len(order) * g < b:
        g += 1
    n_maj = b // g
    r = b - n_maj * g
    n_min = 1 if r > 0 else 0
    rest = len(order) - n_maj - n_min
    n_mis = 1 if (n_min == 1 and rest >= 2) else 0
    spares = order[n_maj + n_min :]
    return (
        g,
        tuple(order[:n_maj]),
        order[n_maj] if n_min else None,
        tuple(spares[: len(spares) - n_mis]),
        tuple(spares[len(spares) - n_mis :]),
    )


def smallest_g_ext(c_cur, w_cur, b):
    g = 1
    while c_cur + w_cur * g < b:
        g += 1
    return g


def split_main_reserve(ids: IdSet, b: int):
    """(ids < B, ids >= B): main-stream and reserve-stream parts."""
    main = [(lo, min(hi, b)) for lo, hi in ids.spans if lo < b]
    reserve = [(max(lo, b), hi) for lo, hi in ids.spans if hi > b]
    return IdSet.union_all([IdSet.range(*s) for s in main]), IdSet.union_all(
        [IdSet.range(*s) for s in reserve]
    )


# ---------------------------------------------------------------------------------------------
# Drawing failures.


def replaceable(state):
    """Contributing replicas that a live spare could replace in the first pass."""
    work = state.work
    spares = [w for w in work.values() if w.base_role in (MAJOR_SPARE, MINOR_SPARE)]
    out = []
    for r in state.live:
        w = work[r]
        if w.base_role not in (MAJOR, MINOR):
            continue
        wanted = MAJOR_SPARE if w.base_role == MAJOR else MINOR_SPARE
        if any(
            s.base_role == wanted and (state.config.mode == "reserve" or s.slot == w.slot)
            for s in spares
        ):
            out.append(r)
    return out


def draw_failed(data, state, allow_all_but_one=True, exclude=()):
    """A set of live replicas, not in `exclude`, to kill now (never all of them)."""
    live = [r for r in state.live if r not in exclude]
    if len(live) == 1:
        return []
    # 0-6: nobody, 7-12: one, 13-16: a few, 17: all but one (sparing enough runs for spares to
    # appear after a boundary and then be promoted).
    how = data.draw(st.integers(0, 17), label="how many")
    if how <= 6:
        return []
    if how == 17 and allow_all_but_one:
        survivor = live[data.draw(st.integers(0, len(live) - 1), label="survivor")]
        return [r for r in live if r != survivor]
    pool_name = data.draw(
        st.sampled_from(["any", "contributors", "spares", "replaceable", "replaceable"]),
        label="among",
    )
    if pool_name == "contributors":
        pool = [r for r in live if state.work[r].held]
    elif pool_name == "spares":
        pool = [r for r in live if state.work[r].base_role in (MAJOR_SPARE, MINOR_SPARE)]
    elif pool_name == "replaceable":
        pool = [r for r in replaceable(state) if r in live]
    else:
        pool = list(live)
    if not pool:
        return []
    n = 1 if how <= 12 else data.draw(st.integers(2, 5), label="several")
    n = min(n, len(pool), len(live) - 1)
    chosen = []
    for _ in range(n):
        chosen.append(pool.pop(data.draw(st.integers(0, len(pool) - 1), label="pick")))
    return chosen


# ---------------------------------------------------------------------------------------------
# Checks.


def check_decision(before, after, failed, decision, classes):
    """Invariants of one static-policy failure record."""
    config = before.config
    b = config.b
    # Determinism: the same record, handed over in another order, gives the same answer.
    again, same = static.apply_failure(before, list(reversed(sorted(failed))))
    assert again == after and same == decision
    assert set(after.work) == set(before.work) - set(failed)
    for dead, spare in decision.promotions:
        classes.add("spare_promotion")
        assert before.round == 0, "promotions only in the first pass"
        dead_work, spare_work = before.work[dead], after.work[spare]
        assert spare_work.contributes_first_pass and spare_work.base_role == dead_work.base_role
        if config.mode == "exact":
            assert spare_work.first_pass == dead_work.held, "a promoted shadow is exact"
    if any(before.work[r].base_role in (MAJOR_SPARE, MINOR_SPARE) for r in failed):
        classes.add("spare_died")
    if not decision.boundary:
        assert decision.restore_mode == BLOCKING and after.rounds == before.rounds
        assert after.contributions() == b
        return
    assert decision.restore_mode == NON_BLOCKING
    w_cur = len(after.live)
    c_cur = b - decision.pool
    g_ext = smallest_g_ext(c_cur, w_cur, b)
    assert decision.g_ext == g_ext == after.rounds[-1]
    assert decision.num_boundary_minor == w_cur * g_ext - (b - c_cur)
    shares = [after.work[r].extension[-1] for r in after.live]
    bdry = [r for r in after.live if after.work[r].boundary_minor]
    assert len(bdry) == decision.num_boundary_minor
    for r in after.live:
        want = g_ext - 1 if r in bdry else g_ext
        assert len(after.work[r].extension[-1]) == want
        assert rank_work(after, r).extension_microbatches == g_ext, "lockstep: all run G_ext"
    new_ids = IdSet.union_all(shares)
    assert len(new_ids) == sum(len(s) for s in shares) == decision.pool
    if config.mode == "exact":
        lost = IdSet.union_all(before.work[r].held for r in failed)
        assert new_ids.issubset(lost), "exact mode recomputes the lost ids themselves"
    else:
        main, _ = split_main_reserve(new_ids, b)
        assert not main, "reserve mode draws replacements from the reserve stream"
    assert after.contributions() == b


def check_rank_queries(state):
    """What the schedules read agrees with the state."""
    total = 0
    for r in state.live:
        work = rank_work(state, r)
        total += len(work.contributed)
        assert work.first_pass, "every live replica runs a first pass"
        assert work.padding_id in work.first_pass
        if work.role in (MAJOR_SPARE, MINOR_SPARE) and state.round == 0:
            assert not work.contributes_first_pass and not work.contributed
            if state.config.mode == "exact":
                shadow = state.layout.slot_ids(state.work[r].slot)
                assert work.first_pass == shadow
    assert total == state.contributions()


def check_static_result(config, result, layout_before, live_before, ledger, classes):
    """Invariants of one committed static-policy iteration."""
    b = config.b
    assert result.contributions == b and result.divisor == b
    assert set(result.roles) == set(live_before) - result.failed
    assert not set(result.per_replica_ids) & result.failed
    parts = list(result.per_replica_ids.values())
    assert sum(len(p) for p in parts) == len(result.committed) == b, "no id committed twice"
    assert IdSet.union_all(parts) == result.committed
    for r, ids in result.per_replica_ids.items():
        assert ids.issubset(result.ran_ids[r]), "a replica commits only ids it ran"
        assert result.ran[r] >= len(ids)
    assert result.grad_accum == layout_before.g_cur
    main, reserve = split_main_reserve(result.committed, b)
    if config.mode == "exact":
        assert result.committed == IdSet.range(0, b), "exact: the failure-free ids"
    else:
        assert main.issubset(IdSet.range(0, b))
        assert reserve.isdisjoint(ledger["reserve_committed"]), "reserve id committed twice"
        ledger["reserve_committed"] = ledger["reserve_committed"] | reserve
        ran_reserve = split_main_reserve(IdSet.union_all(result.ran_ids.values()), b)[1]
        assert ran_reserve.isdisjoint(ledger["reserve_ran"]), "reserve ids are never reused"
        ledger["reserve_ran"] = ledger["reserve_ran"] | ran_reserve
        if reserve:
            classes.add("reserve_ids_committed")
    nxt = result.next_layout
    survivors = sorted(result.roles)
    if result.boundary:
        classes.add("boundary_step")
        if len(result.extension_rounds) >= 2:
            classes.add("nested_extension")
        g, majors, minor, mspares, mispares = reference_algorithm7(survivors, b)
        assert (nxt.g_cur, nxt.majors, nxt.minor) == (g, majors, minor)
        assert (nxt.major_spares, nxt.minor_spares) == (mspares, mispares)
    else:
        assert BOUNDARY_MINOR not in result.roles.values()
        assert (nxt.g_cur, nxt.r_cur) == (layout_before.g_cur, layout_before.r_cur)
        assert len(nxt.majors) == len(layout_before.majors)
    assert sorted(nxt.replicas) == survivors


# ---------------------------------------------------------------------------------------------
# The runs.


def run_static_case(data, config, iterations):
    """Drive a WorkloadPolicy through a drawn schedule; return the scenario classes it hit."""
    policy = WorkloadPolicy(config)
    classes = set()
    ledger = {"reserve_committed": IdSet(), "reserve_ran": IdSet()}
    news = []  # died after the previous commit: detected at this iteration's reduce
    for t in range(1, iterations + 1):
        layout_before = policy.layout
        state = policy.begin(t)
        live_before = state.live
        first = news + draw_failed(data, state, exclude=news)
        failed_all = set(first)
        if first:
            decision = policy.on_failure(first)
            check_decision(state, policy.state, first, decision, classes)
        while policy.state.round > 0:
            state = policy.state
            failed = draw_failed(data, state)
            if not failed:
                break
            classes.add("failure_in_extension")
            failed_all |= set(failed)
            decision = policy.on_failure(failed)
            check_decision(state, policy.state, failed, decision, classes)
        check_rank_queries(policy.state)
        result = policy.commit()
        assert result.failed == frozenset(failed_all)
        if len(result.failed) >= 2:
            classes.add("several_failures_one_iteration")
        check_static_result(config, result, layout_before, live_before, ledger, classes)
        if len(result.roles) == 1 and config.w_init > 1:
            classes.add("one_survivor")
        news = []
        if t < iterations:
            upcoming = static.begin_iteration(config, policy.layout, t + 1)
            news = draw_failed(data, upcoming, allow_all_but_one=False)
            if news:
                classes.add("commit_phase_failure")
    return classes


MINIMUMS = {
    "spare_promotion": 150,
    "boundary_step": 1000,
    "failure_in_extension": 300,
    "several_failures_one_iteration": 300,
    "one_survivor": 150,
    "nested_extension": 100,
    "spare_died": 100,
    "commit_phase_failure": 200,
}


def _run_static(mode, max_examples, tally):
    counter = tally.setdefault(f"static/{mode}/{max_examples}", collections.Counter())

    @settings(max_examples=max_examples, **SETTINGS)
    @given(w_init=w_inits, g_init=g_inits, iterations=st.integers(1, 6), data=st.data())
    def case(w_init, g_init, iterations, data):
        config = PolicyConfig(w_init, g_init, mode=mode)
        classes = run_static_case(data, config, iterations)
        counter["cases"] += 1
        for name in sorted(classes):
            event(name)
            counter[name] += 1

    case()
    return counter


# The minimums above are for FULL_CASES generated cases; `make test` runs a fifth of them (each
# minimum scaled alike), `make test-long` the full count.
FULL_CASES = 5000
CASES = [pytest.param(FULL_CASES // 5, id="ci"),
         pytest.param(FULL_CASES, id="full", marks=pytest.mark.long)]


@pytest.mark.parametrize("cases", CASES)
def test_static_exact_properties(scenario_tally, cases):
    counter = _run_static("exact", cases, scenario_tally)
    for name, minimum in MINIMUMS.items():
        assert counter[name] >= minimum * cases // FULL_CASES, (name, counter)


@pytest.mark.parametrize("cases", CASES)
def test_static_reserve_properties(scenario_tally, cases):
    counter = _run_static("reserve", cases * 4 // 5, scenario_tally)
    # Fewer cases than the exact-mode run: scale its minimums down accordingly.
    minimums = dict(MINIMUMS, reserve_ids_committed=150)
    for name, minimum in minimums.items():
        assert counter[name] >= minimum * cases * 4 // 5 // FULL_CASES, (name, counter)


def test_adaptive_properties(scenario_tally):
    counter = scenario_tally.setdefault("adaptive", collections.Counter())

    @settings(max_examples=1500, **SETTINGS)
    @given(w_init=w_inits, g_init=g_inits, iterations=st.integers(1, 5), data=st.data())
    def case(w_init, g_init, iterations, data):
        config = PolicyConfig(w_init, g_init, policy="adaptive")
        policy = WorkloadPolicy(config)
        classes = set()
        for t in range(1, iterations + 1):
            state = policy.begin(t)
            failed = draw_failed(data, state)
            if failed:
                decision = policy.on_failure(failed)
                assert decision.restore_mode == BLOCKING and not decision.boundary
                assert decision.dropped == sum(len(state.work[r].held) for r in failed)
                again, _ = adaptive.apply_failure(state, reversed(failed))
                assert again == policy.state
                classes.add("several_failures_one_iteration" if len(failed) > 1 else "failure")
            survivors = policy.state.live
            result = policy.commit()
            assert not result.boundary and result.extra_microbatches == 0
            assert set(result.roles.values()) == {MAJOR}
            expected = IdSet.union_all(
                IdSet.range(r * g_init, (r + 1) * g_init) for r in survivors
            )
            assert result.committed == expected, "survivors keep their own slices"
            assert result.contributions == len(survivors) * g_init == result.divisor
            parts = list(result.per_replica_ids.values())
            assert sum(len(p) for p in parts) == result.contributions
            if len(survivors) == 1:
                classes.add("one_survivor")
        counter["cases"] += 1
        for name in sorted(classes):
            event(name)
            counter[name] += 1

    case()
    assert counter["several_failures_one_iteration"] >= 100, counter
    assert counter["one_survivor"] >= 100, counter


def test_algorithm7_properties(scenario_tally):
    counter = scenario_tally.setdefault("algorithm7", collections.Counter())

    @settings(max_examples=1500, **SETTINGS)
    @given(b=st.integers(1, 8192), data=st.data())
    def case(b, data):
        w = data.draw(st.integers(1, min(b, 64)), label="W_cur")
        layout = advance_layout(range(100, 100 + w), b)
        g, majors, minor, mspares, mispares = reference_algorithm7(range(100, 100 + w), b)
        assert (layout.g_cur, layout.majors, layout.minor) == (g, majors, minor)
        assert (layout.major_spares, layout.minor_spares) == (mspares, mispares)
        assert w * (layout.g_cur - 1) < b <= w * layout.g_cur, "G_cur is the smallest"
        assert len(layout.majors) * layout.g_cur + layout.r_cur == b
        assert len(layout.replicas) == w
        spare_work = layout.g_cur * len(layout.major_spares) + layout.r_cur * len(
            layout.minor_spares
        )
        assert spare_work < w, "spares never run more than W_cur microbatches"
        counter["cases"] += 1
        kind = "with_minor_spare" if layout.minor_spares else (
            "with_spares" if layout.major_spares else "no_spares"
        )
        event(kind)
        counter[kind] += 1

    case()
    assert counter["with_minor_spare"] >= 50 and counter["with_spares"] >= 50, counter
