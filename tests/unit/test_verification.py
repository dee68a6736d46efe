"""Sampled cross-replica verification (megatron_recover/recovery/verification.py,
docs/verification.md): the pure parts, then the protocol in one process (`testing.lockstep`),
where every gradient sum is exact, so a survivor's committed gradient is compared bitwise with
the failure-free one computed from the dataset alone.

Run: .venv/bin/python -m pytest tests/unit/test_verification.py   (no MPI; seconds)
"""

import pytest
import torch

from megatron_recover.errors import SilentCorruption, UnresolvedCorruption
from megatron_recover.faults.schedule import flip_bit
from megatron_recover.recovery.verification import (
    WIDTH,
    Fingerprint,
    Slots,
    arbiter,
    judge,
    pairs,
    sampled,
)
from megatron_recover.testing.lockstep import (
    Failure,
    Setup,
    assert_failure_free_steps,
    failure_free_gradient,
    run_lockstep,
)

pytestmark = pytest.mark.unit


def test_the_checkers_form_a_cycle_over_the_live_replicas():
    live = [0, 2, 3, 5]
    checks = pairs(7, 1, live, live, rate=1.0)
    assert checks == {0: 2, 2: 3, 3: 5, 5: 0}
    assert sorted(checks.values()) == live  # each replica runs at most one extra pass
    assert arbiter(3, 5, live) == 0 and arbiter(5, 0, live) == 2
    assert arbiter(0, 2, [0, 2]) is None
    assert pairs(7, 1, [4], [4], rate=1.0) == {}  # nobody to check a lone replica


def test_the_sample_is_deterministic_and_near_the_rate():
    draws = [sampled(11, t, r, 0.25) for t in range(1, 401) for r in range(10)]
    assert draws == [sampled(11, t, r, 0.25) for t in range(1, 401) for r in range(10)]
    assert 0.22 < sum(draws) / len(draws) < 0.28
    assert draws != [sampled(12, t, r, 0.25) for t in range(1, 401) for r in range(10)]
    assert not any(sampled(11, t, 0, 0.0) for t in range(100))
    assert all(sampled(11, t, 0, 1.0) for t in range(100))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_flipped_bit_of_a_bucket_changes_its_fingerprint(dtype):
    """Over a bucket longer than the projection's tile (so its weights repeat), every
    exponent and high mantissa bit, at elements spread over the bucket."""
    fingerprint = Fingerprint(3)
    grad = (torch.randn(150_001, generator=torch.Generator().manual_seed(5)) * 1e-3).to(dtype)
    clean = fingerprint.bucket(0, grad)
    assert torch.equal(clean, fingerprint.bucket(0, grad.clone()))  # bitwise reproducible
    mantissa = 23 if dtype == torch.float32 else 7
    for element in (0, 65_535, 65_536, 100_000, 150_000):
        for bit in range(mantissa - 3, mantissa + 8):
            flipped = grad.clone()
            flip_bit(flipped[element:element + 1], bit)
            assert not torch.equal(fingerprint.bucket(0, flipped), clean), (element, bit)
    assert not torch.equal(fingerprint.bucket(1, grad), clean)  # each bucket its own weights


def test_slots_hold_each_replicas_fingerprints_through_the_sum():
    slots = Slots(4)
    a, b, c = (torch.randn(WIDTH, dtype=torch.float64) for _ in range(3))
    summed = (slots.encode({"own": {1: a}}) + slots.encode({"check": {1: b}, "own": {2: c}})
              + slots.encode({}))
    decoded = slots.decode(summed)
    assert set(decoded["own"]) == {1, 2} and set(decoded["check"]) == {1}
    assert torch.equal(decoded["own"][1], a) and torch.equal(decoded["check"][1], b)
    assert decoded["arbiter"] == {}


def _fingerprints(own, check, third=None):
    value = {"good": torch.tensor([1.0, 2.0], dtype=torch.float64),
             "bad": torch.tensor([1.0, 2.5], dtype=torch.float64),
             "worse": torch.tensor([0.5, 2.0], dtype=torch.float64)}
    out = {"own": {1: value[own]}, "check": {1: value[check]}, "arbiter": {}}
    if third is not None:
        out["arbiter"][1] = value[third]
    return out


@pytest.mark.parametrize("own, check, third, live, field, replicas", [
    ("good", "good", None, [0, 1, 2], "checked", {1}),
    ("bad", "good", None, [0, 1, 2], "suspects", {1}),
    ("bad", "good", "good", [0, 1, 2], "evict", {1}),  # the owner is wrong
    ("good", "bad", "good", [0, 1, 2], "evict", {2}),  # the checker is wrong
    ("bad", "good", "worse", [0, 1, 2], "unresolved", {1}),  # three answers
    ("bad", "good", None, [1, 2], "unresolved", {1}),  # nobody to arbitrate
    ("bad", "good", None, [0, 2], "checked", set()),  # the owner is gone: its work is redone
])
def test_judge(own, check, third, live, field, replicas):
    judgement = judge(_fingerprints(own, check, third), {1: 2}, live, tolerance=0.0)
    assert getattr(judgement, field) == replicas
    flagged = judgement.suspects | judgement.evict | judgement.unresolved
    assert flagged == (replicas if field != "checked" else set())


def test_a_tolerance_accepts_what_is_within_it():
    a = torch.tensor([1.0, 2.0], dtype=torch.float64)
    close = {"own": {1: a}, "check": {1: a * (1 + 1e-7)}, "arbiter": {}}
    assert judge(close, {1: 2}, [0, 1, 2], tolerance=1e-6).suspects == set()
    assert judge(close, {1: 2}, [0, 1, 2], tolerance=0.0).suspects == {1}


# --- the protocol, in one process ------------------------------------------------------------

def test_a_flipped_bit_is_caught_arbitrated_and_its_replica_evicted():
    setup = Setup(w_init=4, g_init=2, iterations=3, sdc_check_rate=1.0,
                  failures=(Failure(replica=1, iteration=2, location="bitflip"),))
    runs, _ = run_lockstep(setup)
    assert isinstance(runs[1].error, SilentCorruption), runs[1].error
    assert len(runs[1].reports) == 1  # it committed nothing of iteration 2
    survivors = [0, 2, 3]
    assert all(runs[r].error is None and len(runs[r].reports) == 3 for r in survivors)
    assert_failure_free_steps(runs, survivors, 3)
    report = runs[0].reports[1]
    kinds = [e["event"] for e in report.events]
    assert kinds[:3] == ["mismatch", "corruption", "failure"], report.events
    mismatch, corruption, failure = report.events[:3]
    assert (mismatch["owners"], mismatch["checkers"], mismatch["arbiters"]) == ([1], [2], [3])
    assert corruption["evicted"] == [1] and failure["replicas"] == [1]
    assert failure["cause"] == "silent corruption"
    # Every id of iterations 1 and 3 was computed twice and agreed; in iteration 2 those of
    # replicas 2 and 3 (replica 0's checker was the evicted one; its own ids were redone).
    assert [r.verified for r in runs[0].reports] == [8, 4, 8]
    assert all(r.invariant_ok and r.contributions == 8 for r in runs[0].reports)


def test_without_verification_the_flipped_bit_is_committed():
    """The negative control: the same flip at rate 0 reaches every replica's step."""
    setup = Setup(w_init=4, g_init=2, iterations=3,
                  failures=(Failure(replica=1, iteration=2, location="bitflip"),))
    runs, _ = run_lockstep(setup)
    assert all(runs[r].error is None and len(runs[r].reports) == 3 for r in range(4))
    replica = runs[0].replica
    assert torch.equal(replica.optimizer.stepped[0], failure_free_gradient(replica.audit, 1))
    assert not torch.equal(replica.optimizer.stepped[1], failure_free_gradient(replica.audit, 2))
    assert all(r.verified == 0 for r in runs[0].reports)


def test_a_device_wrong_in_every_pass_is_evicted_as_owner_and_as_checker():
    """Replica 2 is wrong in its own pass and in its check of replica 1: both mismatches are
    arbitrated and both name replica 2."""
    setup = Setup(w_init=4, g_init=2, iterations=3, sdc_check_rate=1.0,
                  failures=(Failure(replica=2, iteration=2, location="faulty"),))
    runs, _ = run_lockstep(setup)
    assert isinstance(runs[2].error, SilentCorruption), runs[2].error
    survivors = [0, 1, 3]
    assert all(runs[r].error is None and len(runs[r].reports) == 3 for r in survivors)
    assert_failure_free_steps(runs, survivors, 3)
    mismatch = runs[0].reports[1].events[0]
    assert mismatch["owners"] == [1, 2] and mismatch["checkers"] == [2, 3]


def test_with_two_replicas_a_mismatch_ends_the_job_uncommitted():
    setup = Setup(w_init=2, g_init=2, iterations=3, sdc_check_rate=1.0,
                  failures=(Failure(replica=0, iteration=2, location="bitflip"),))
    runs, _ = run_lockstep(setup)
    for rank in (0, 1):
        assert isinstance(runs[rank].error, UnresolvedCorruption), runs[rank].error
        assert "no third live replica" in str(runs[rank].error)
        assert len(runs[rank].reports) == 1


def test_a_partial_rate_checks_about_that_share_and_stays_exact():
    setup = Setup(w_init=4, g_init=2, iterations=12, sdc_check_rate=0.5)
    runs, _ = run_lockstep(setup)
    assert all(runs[r].error is None for r in range(4))
    assert_failure_free_steps(runs, range(4), 12)
    verified = [r.verified for r in runs[0].reports]
    assert all(v % 2 == 0 and 0 <= v <= 8 for v in verified)
    assert 0 < sum(verified) < 12 * 8, verified
    ran = len(runs[0].replica.run_pass.ran) + len(runs[1].replica.run_pass.ran)
    assert ran > 12 * 2 * 2  # the checkers ran some ids twice


# Each must make the flipped-bit run above commit a gradient other than the failure-free one.
MUTATIONS = [
    ("the check pass's gradient left in the buckets",
     "                p.buffers.zero()\n                p.optimizer.zero_grad()\n",
     "                p.optimizer.zero_grad()\n"),
    ("the fingerprints never judged",
     "self._judgement = judge(", "self._judgement = Judgement() or judge("),
    ("the owner's fingerprint taken after its reduction",
     "                core.p.replica: sum_fingerprints(core.recovery.fingerprints)}",
     "                core.p.replica: self.fingerprint.buckets(core.recovery.grads)}"),
]


@pytest.mark.parametrize("name, old, new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_verification_mutation_is_caught(monkeypatch, name, old, new):
    from tests.unit.test_mutations import mutate

    mutate(monkeypatch, "megatron_recover/recovery/checks/sdc.py", old, new)
    setup = Setup(w_init=4, g_init=2, iterations=3, sdc_check_rate=1.0,
                  failures=(Failure(replica=1, iteration=2, location="bitflip"),))
    runs, _ = run_lockstep(setup, timeout_s=30)
    survivors = [r for r in range(4) if runs[r].error is None and len(runs[r].reports) == 3]
    with pytest.raises(AssertionError) as caught:
        assert survivors, [runs[r].error for r in range(4)]
        assert_failure_free_steps(runs, survivors, 3)
    print(f"CAUGHT {name}: {str(caught.value).splitlines()[0]}")
