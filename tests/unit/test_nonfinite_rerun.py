"""--recover-nonfinite-rerun in the round protocol, in one process: a replica whose first pass
fails the NaN/inf check holds it out, reruns it, has another replica run it, and the fault is
classified before anything of the iteration commits.

Run: .venv/bin/python -m pytest tests/unit/test_nonfinite_rerun.py   (no MPI; seconds)

Every gradient sum of the lockstep replicas is exact, so a survivor's steps are compared bitwise
with the failure-free gradient computed from the dataset alone (`failure_free_gradient`), not
with anything the protocol produced.
"""

import math

import pytest

from megatron_recover.errors import NonFiniteData, NonFiniteResult
from megatron_recover.recovery.rerun import (
    CHECKER,
    DATA,
    PERSISTENT,
    TRANSIENT,
    UNKNOWN,
    RerunSlots,
    RerunView,
    checkers,
    classify,
)
from megatron_recover.testing.lockstep import (
    Failure,
    Setup,
    assert_failure_free_steps,
    run_lockstep,
    sample_range,
)

pytestmark = pytest.mark.unit
ITERATIONS = 3
TIMEOUT_S = 60.0  # a round that cannot complete fails the run after this


def _events(runs, rank, kind):
    return [(report.iteration, e) for report in runs[rank].reports for e in report.events
            if e["event"] == kind]


def test_the_classification_table():
    assert classify(own_bad=False, checker=3, check_bad=False) == TRANSIENT
    assert classify(own_bad=True, checker=3, check_bad=False) == PERSISTENT
    assert classify(own_bad=True, checker=3, check_bad=True) == DATA
    assert classify(own_bad=False, checker=3, check_bad=True) == CHECKER
    assert classify(own_bad=True, checker=None, check_bad=False) == UNKNOWN
    assert classify(own_bad=False, checker=None, check_bad=False) == TRANSIENT


def test_checkers_are_the_next_live_replica_that_is_not_a_suspect():
    assert checkers([2], [0, 1, 2, 3]) == {2: 3}
    assert checkers([3], [0, 1, 3]) == {3: 0}
    assert checkers([1, 2], [0, 1, 2, 3]) == {1: 3, 2: 3}
    assert checkers([0, 1], [0, 1]) == {0: 1, 1: 0}  # only suspects left: still another one
    assert checkers([4], [4]) == {4: None}


def test_the_lane_slots_sum_to_their_flags():
    slots = RerunSlots(5)
    one = slots.encode(RerunView(nonfinite=frozenset({2}), own_bad=frozenset({2})))
    other = slots.encode(RerunView(check_bad=frozenset({2})))
    assert slots.decode(one + other + one) == RerunView(frozenset({2}), frozenset({2}),
                                                        frozenset({2}))
    assert slots.decode(slots.encode(RerunView())) == RerunView()
    with pytest.raises(ValueError):
        slots.encode(RerunView(nonfinite=frozenset({5})))


def test_without_reruns_a_nan_replica_leaves_at_once():
    """The default (and the control for the runs below): Megatron's check raises on the
    replica, which leaves; the others redo its microbatches."""
    setup = Setup(w_init=4, g_init=2, iterations=ITERATIONS,
                  failures=(Failure(replica=2, iteration=2, location="nan"),))
    runs, _ = run_lockstep(setup, TIMEOUT_S)
    assert isinstance(runs[2].error, NonFiniteResult), runs[2].error
    assert "before the cross-replica reduction" in str(runs[2].error)
    assert_failure_free_steps(runs, [0, 1, 3], ITERATIONS)
    assert [r.live_replicas for r in runs[0].reports] == [4, 3, 3]


def test_a_transient_nan_is_kept_and_the_run_is_the_failure_free_one():
    setup = Setup(w_init=4, g_init=2, iterations=ITERATIONS, nonfinite_rerun="keep",
                  failures=(Failure(replica=2, iteration=2, location="nan"),))
    runs, world = run_lockstep(setup, TIMEOUT_S)
    assert all(runs[r].error is None for r in range(4)), [runs[r].error for r in range(4)]
    assert world.nonfinite_sent == []  # the NaN never left replica 2
    assert_failure_free_steps(runs, range(4), ITERATIONS)
    assert [r.live_replicas for r in runs[0].reports] == [4, 4, 4]
    assert [r.contributions for r in runs[0].reports] == [8, 8, 8]
    [(t, held)] = _events(runs, 0, "nonfinite")
    assert t == 2 and held["replicas"] == [2] and held["checkers"] == [3]
    [(_, rerun)] = _events(runs, 0, "rerun")
    assert rerun["outcomes"] == {"2": TRANSIENT} and rerun["kept"] == [2]
    # The reruns did run: replica 2 ran its ids of iteration 2 twice, replica 3 them once more.
    ran = runs[2].replica.run_pass.ran
    assert ran.count((2, 4)) == ran.count((2, 5)) == 2
    assert (2, 4) in runs[3].replica.run_pass.ran


def test_a_transient_nan_is_evicted_when_asked():
    setup = Setup(w_init=4, g_init=2, iterations=ITERATIONS, nonfinite_rerun="evict",
                  failures=(Failure(replica=2, iteration=2, location="nan"),))
    runs, _ = run_lockstep(setup, TIMEOUT_S)
    assert isinstance(runs[2].error, NonFiniteResult), runs[2].error
    assert "a transient fault, evicted as --recover-nonfinite-rerun evict" in str(runs[2].error)
    assert_failure_free_steps(runs, [0, 1, 3], ITERATIONS)
    assert [r.live_replicas for r in runs[0].reports] == [4, 3, 3]
    [(_, failure)] = _events(runs, 0, "failure")
    assert failure["replicas"] == [2] and failure["cause"] == "non-finite gradient"


@pytest.mark.parametrize("w_init, victim", [(4, 1), (2, 1)])
def test_a_device_nan_in_every_pass_is_evicted_even_when_keeping(w_init, victim):
    setup = Setup(w_init=w_init, g_init=2, iterations=ITERATIONS, nonfinite_rerun="keep",
                  failures=(Failure(replica=victim, iteration=2, location="nan-always"),))
    runs, _ = run_lockstep(setup, TIMEOUT_S)
    assert isinstance(runs[victim].error, NonFiniteResult), runs[victim].error
    assert "its device is taken for faulty" in str(runs[victim].error)
    survivors = [r for r in range(w_init) if r != victim]
    assert_failure_free_steps(runs, survivors, ITERATIONS)
    [(_, rerun)] = _events(runs, survivors[0], "rerun")
    assert rerun["outcomes"] == {str(victim): PERSISTENT} and rerun["evicted"] == [victim]


def test_data_that_gives_nan_anywhere_ends_the_job_uncommitted_with_its_samples():
    setup = Setup(w_init=4, g_init=2, iterations=ITERATIONS, nonfinite_rerun="keep",
                  nan_ids=((2, 3),))  # replica 1's second microbatch of iteration 2
    runs, _ = run_lockstep(setup, TIMEOUT_S)
    samples = sample_range(runs[0].replica.audit, 2, 3)
    for rank in range(4):
        error = runs[rank].error
        assert isinstance(error, NonFiniteData), (rank, error)
        assert "microbatches [2, 3]" in str(error) and f"{samples.start}" in str(error)
        assert "on replica 1 twice and on replica 2" in str(error)
        assert len(runs[rank].replica.optimizer.stepped) == 1  # iteration 2 never stepped
        assert not any(math.isnan(x) for x in runs[rank].replica.optimizer.params.tolist())


def test_without_reruns_bad_data_takes_replicas_out_one_by_one():
    """The control for the run above: without reruns, the replica whose microbatch it is leaves,
    and the replica that redoes it in the extension pass fails the same check."""
    setup = Setup(w_init=4, g_init=2, iterations=ITERATIONS, nan_ids=((2, 3),))
    runs, _ = run_lockstep(setup, TIMEOUT_S)
    failed = [r for r in range(4) if isinstance(runs[r].error, NonFiniteResult)]
    assert len(failed) >= 2, [runs[r].error for r in range(4)]


# Each must make one of the runs above fail its checks.
MUTATIONS = [
    ("the held-out bucket sent anyway",
     "        if not self.mode.contributing or self.nonfinite:\n",
     "        if not self.mode.contributing:\n", "megatron_recover/recovery/gradients.py", "keep"),
    ("the held-out first pass not said in the lane",
     "nonfinite=frozenset([core.p.replica] if core.recovery.nonfinite else [])",
     "nonfinite=frozenset()", "megatron_recover/recovery/checks/nonfinite.py", "keep"),
    ("the suspect's rerun not kept in its buckets",
     "        if self.p.restore and not held:\n", "        if self.p.restore:\n",
     "megatron_recover/recovery/round.py", "keep"),
    ("a transient fault kept when evicting was asked",
     "(o in (TRANSIENT, CHECKER) and self.mode != KEEP)}",
     "(o in (TRANSIENT, CHECKER) and False)}", "megatron_recover/recovery/checks/nonfinite.py",
     "evict"),
]


@pytest.mark.parametrize("name, old, new, path, mode", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_rerun_mutation_is_caught(monkeypatch, name, old, new, path, mode):
    from tests.unit.test_mutations import mutate

    mutate(monkeypatch, path, old, new)
    monkeypatch.setattr(f"{__name__}.TIMEOUT_S", 20.0)
    if mode == "keep":
        test = test_a_transient_nan_is_kept_and_the_run_is_the_failure_free_one
    else:
        test = test_a_transient_nan_is_evicted_when_asked
    with pytest.raises(AssertionError) as caught:
        test()
    print(f"CAUGHT {name}: {str(caught.value).splitlines()[0]}")
