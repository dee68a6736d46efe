"""The round protocol in one process: several replicas in lockstep over a fake ulfm group.

Run: .venv/bin/python -m pytest tests/unit -m unit   (no MPI, no GPU; well under a minute)

Each case runs the real `ResilientTrainer`, `GradientRecovery`, `WorkloadPolicy` and
`DatasetAudit` on threads (`megatron_recover.testing.lockstep`) and checks, from what happened
(`megatron_recover.testing.invariants.check_run`): every scheduled kill that must fire fired,
every survivor committed every iteration, the ledger audit held, each stepped gradient is the
sum of the gradients its ledger names and, in exact mode, the failure-free gradient bitwise, and
survivors hold the same parameters as each other and as the failure-free run. Gradients are
small integers, so every sum is exact whatever the grouping.
"""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megatron_recover.testing.invariants import check_run
from megatron_recover.testing.lockstep import (
    BUCKETS,
    LOCATIONS,
    Failure,
    Setup,
    run_lockstep,
)

pytestmark = pytest.mark.unit
# The data planes (docs/data-planes.md): the fake ulfm group itself, or the torch plane's
# protocol over it (`fake_ulfm.FakeTorchPlane`).
PLANES = ("mpi", "torch")


def run_and_check(setup: Setup, events: bool = False) -> list[int]:
    runs, world = run_lockstep(setup, timeout_s=30)
    survivors = check_run(setup, runs, world)
    if events:  # --hypothesis-show-statistics reports how many cases lost replicas
        event(f"{setup.w_init - len(survivors)} replica(s) died")
        event(f"extension passes: {max(r.extension_rounds for r in runs[survivors[0]].reports)}")
    return survivors


@st.composite
def setups(draw, policy=None, mode=None):
    w_init = draw(st.integers(2, 5))
    g_init = draw(st.integers(1, 3))
    policy = policy or draw(st.sampled_from(["static", "adaptive"]))
    mode = mode or ("exact" if policy == "adaptive" else draw(st.sampled_from(["exact",
                                                                              "reserve"])))
    iterations = draw(st.integers(2, 4))
    victims = draw(st.lists(st.integers(0, w_init - 1), unique=True, min_size=1,
                            max_size=min(3, w_init - 1)))
    failures = []
    for replica in victims:
        location = draw(st.sampled_from(LOCATIONS))
        lucky = ()
        if location == "reduce-contributed":
            others = [r for r in range(w_init) if r != replica]
            lucky = tuple(draw(st.lists(st.sampled_from(others), unique=True)))
        failures.append(Failure(replica=replica, iteration=draw(st.integers(1, iterations)),
                                location=location,
                                occurrence=draw(st.integers(1, len(BUCKETS))), lucky=lucky))
    return Setup(w_init=w_init, g_init=g_init, iterations=iterations, policy=policy, mode=mode,
                 overlap=draw(st.booleans()), failures=tuple(failures),
                 plane=draw(st.sampled_from(PLANES)))


PROPERTY = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(setups(policy="static", mode="exact"))
def test_exact_mode_commits_the_failure_free_gradient(setup):
    run_and_check(setup, events=True)


@PROPERTY
@given(setups())
def test_every_policy_and_mode_keeps_its_invariant(setup):
    run_and_check(setup, events=True)


@pytest.mark.parametrize("plane", PLANES)
def test_a_promotion_then_two_failures_in_one_iteration(plane):
    """W=8, G=2. Iteration 1: replica 1 dies inside a reduce after contributing (replica 0 sees
    that reduce complete, the others repair): a boundary, after which replica 7 is the spare
    shadowing replica 0. Iteration 2: replica 0 dies inside its second bucket's reduce: the
    spare is promoted (blocking restore). Iteration 3: replicas 5 and 6 die in the same round
    (one inside the consensus, one right after posting): one boundary for both."""
    setup = Setup(w_init=8, g_init=2, iterations=4, failures=(
        Failure(1, 1, "reduce-contributed", 2, lucky=(0,)),
        Failure(0, 2, "during-reduce", 2),
        Failure(5, 3, "in-consensus"), Failure(6, 3, "after-post")), plane=plane)
    runs, world = run_lockstep(setup, timeout_s=30)
    assert check_run(setup, runs, world) == [2, 3, 4, 7]
    failures = {r.iteration: [e for e in r.events if e["event"] == "failure"]
                for r in runs[2].reports}
    assert [e["replicas"] for e in failures[1]] == [[1]]
    assert [(e["replicas"], e["restore"], e["promotions"]) for e in failures[2]] == [
        ([0], "blocking", [[0, 7]])]
    assert [(e["replicas"], e["restore"]) for e in failures[3]] == [([5, 6], "non_blocking")]
    assert ("revoked", 0, 1) in world.log  # replica 0 learnt of iteration 1's repair late


def test_exact_survivors_can_be_compared_with_a_control_that_fails():
    """The negative control (no restore) must break what check_run asserts: the checks can
    fail."""
    setup = Setup(w_init=3, g_init=2, failures=(Failure(1, 2, "during-reduce", 2),),
                  restore=False)
    runs, world = run_lockstep(setup, timeout_s=30)
    assert not [run.error for run in runs.values() if run.error]  # it ran, then deviated
    with pytest.raises(AssertionError, match="gradient|invariant|ids missing"):
        check_run(setup, runs, world)


@pytest.mark.parametrize("plane", PLANES)
def test_a_failure_free_run_has_one_epoch_and_b_contributions(plane):
    setup = Setup(w_init=4, g_init=2, iterations=3, plane=plane)
    runs, world = run_lockstep(setup, timeout_s=30)
    assert check_run(setup, runs, world) == [0, 1, 2, 3]
    assert {r.epoch for run in runs.values() for r in run.reports} == {0}
    assert not world.log
