"""One mutation per registered check (`megatron_recover/recovery/checks/`), each caught by a
test of the unit tier, and the side-sums check's own exactness test.

Run: .venv/bin/python -m pytest tests/unit/test_check_mutations.py -s   (no MPI; seconds)

Each mutation breaks what its check contributes to the round (its lane segment, its verdict
segment, the action it asks for, or what it feeds the commit) and runs a test that holds on the
unmutated code; that test must fail. `-s` prints a CAUGHT line per mutation.
"""

import pytest

from megatron_recover.testing.invariants import check_run
from megatron_recover.testing.lockstep import Failure, Setup, run_lockstep
from tests.unit import test_mutations, test_nonfinite_rerun, test_stragglers, test_verification
from tests.unit.test_mutations import mutate

pytestmark = pytest.mark.unit

CHECKS = "megatron_recover/recovery/checks/"
W, G, ITERATIONS = 3, 2, 3
B = W * G
SIDE = Setup(w_init=W, g_init=G, iterations=ITERATIONS, side=True,
             failures=(Failure(1, 2, "during-reduce", 2),))


def expected_side(iteration: int) -> list[float]:
    """The failure-free iteration's side sums, from the definition of the values alone: every
    id k < B once, valued 1000 t + k + 1 (`lockstep.side_values`)."""
    return [float(sum(1000 * iteration + k + 1 for k in range(B))), float(B)]


def test_side_sums_are_the_committed_microbatches_through_a_failure():
    """Replica 1 dies in iteration 2's reduction (a boundary: the survivors redo its ids in an
    extension pass); every survivor's side sums are the failure-free iteration's."""
    runs, world = run_lockstep(SIDE, timeout_s=30)
    survivors = check_run(SIDE, runs, world)
    assert survivors == [0, 2]
    assert any(e["event"] == "failure" for e in runs[0].reports[1].events)  # it fired
    for rank in survivors:
        assert [r.side_sums for r in runs[rank].reports] == [
            expected_side(t) for t in range(1, ITERATIONS + 1)]


def _side_test():
    test_side_sums_are_the_committed_microbatches_through_a_failure()


def _audit_test():
    """The layer-2 mutation 'rewind before the extension pass skipped' must be caught by the
    ledger audit's verdict."""
    mutation = next(m for m in test_mutations.LAYER2 if m.name.startswith("rewind before"))
    import _pytest.monkeypatch
    with _pytest.monkeypatch.MonkeyPatch.context() as patch:
        test_mutations.test_the_ledger_catches_a_layer2_mutation(patch, mutation)


def _sdc_test():
    test_verification.test_a_flipped_bit_is_caught_arbitrated_and_its_replica_evicted()


MUTATIONS = [
    ("nonfinite-reruns: a non-finite bucket not held out (raises at once)",
     CHECKS + "nonfinite.py", 'return {"hold_nonfinite": not core.extended}',
     'return {"hold_nonfinite": False}',
     test_nonfinite_rerun.test_a_transient_nan_is_kept_and_the_run_is_the_failure_free_one),
    ("sdc: a mismatch never holds the round",
     CHECKS + "sdc.py", "return HOLD if any(self._sets(verdict).values()) else COMMIT",
     "return COMMIT", _sdc_test),
    ("ledger-audit: a problem not said in the verdict",
     CHECKS + "ledger_audit.py", "return torch.tensor([float(bool(self.problems))],",
     "return torch.tensor([0.0],", _audit_test),
    ("stragglers: the agreed times not fed to the policy's commit",
     CHECKS + "stragglers.py", 'return {"times": self.speeds(verdict)}', 'return {"times": {}}',
     test_stragglers.test_a_slow_replica_gets_fewer_microbatches_and_a_failure_stays_exact),
    ("side-sums: the first committed sums kept for the run",
     CHECKS + "side_sums.py", "self.summed = lane.tolist()",
     "self.summed = self.summed or lane.tolist()", _side_test),
]


@pytest.mark.parametrize("name, path, old, new, test", MUTATIONS,
                         ids=[m[0].split(":")[0] for m in MUTATIONS])
def test_a_check_mutation_is_caught(monkeypatch, name, path, old, new, test):
    mutate(monkeypatch, path, old, new)
    monkeypatch.setattr(test_nonfinite_rerun, "TIMEOUT_S", 20.0)
    with pytest.raises(AssertionError) as caught:
        test()
    print(f"CAUGHT {name}: {str(caught.value).splitlines()[0]}")
