"""Stragglers in the round protocol, in one process: the replicas measure their first pass, the
commit lane carries the times, the policy moves microbatches away from a slow replica (and
evicts one far slower), and every committed iteration stays the failure-free one.

Run: .venv/bin/python -m pytest tests/unit/test_stragglers.py   (no MPI; seconds)

The lockstep passes take microseconds, far below a thread's scheduling noise, so every replica
also sleeps BASE_S per microbatch (a device's compute time); the slow one sleeps more. Whether
work moves depends on those times; exactness must not: survivors' steps are compared bitwise with
the failure-free gradient computed from the dataset alone.
"""

import pytest

from megatron_recover.errors import Straggler
from megatron_recover.policy.speed import StragglerConfig
from megatron_recover.testing.invariants import check_run
from megatron_recover.testing.lockstep import (
    Failure,
    Setup,
    assert_failure_free_steps,
    run_lockstep,
)
from tests.unit.test_mutations import mutate

pytestmark = pytest.mark.unit
BASE_S = 0.01  # every replica's seconds per microbatch
ITERATIONS = 9
SLOW, FROM = 2, 3  # replica 2 is slowed from iteration 3 on
WINDOW = 2


def setup(extra_s: float, evict: float = 0.0, failures=()) -> Setup:
    return Setup(w_init=4, g_init=4, iterations=ITERATIONS, failures=failures,
                 straggler=StragglerConfig(0.5, WINDOW, evict),
                 slow=tuple((r, 1, ITERATIONS, BASE_S) for r in range(4))
                 + ((SLOW, FROM, ITERATIONS, extra_s),))


def quotas(run) -> list[int]:
    """The slow replica's first-pass microbatches in each iteration."""
    return [report.quotas.get(SLOW, 0) for report in run.reports]


def test_a_slow_replica_gets_fewer_microbatches_and_a_failure_stays_exact():
    """Replica 2 takes 4x as long from iteration 3; replica 3 dies in iteration 6's reduction.
    The quota of replica 2 drops once it was slow for the window (3 and 4: from iteration 5),
    the failure is recovered in the balanced layout, and every step is the failure-free one."""
    case = setup(3 * BASE_S, failures=(Failure(3, 6, "during-reduce"),))
    runs, world = run_lockstep(case, timeout_s=60)
    survivors = check_run(case, runs, world)
    assert survivors == [0, 1, 2]
    assert_failure_free_steps(runs, survivors, ITERATIONS)
    run = runs[0]
    assert quotas(run)[:4] == [4, 4, 4, 4] and all(q < 4 for q in quotas(run)[4:]), quotas(run)
    assert [sorted(r.quotas) for r in run.reports[6:]] == [[0, 1, 2]] * 3
    assert all(sum(r.quotas.values()) == 16 for r in run.reports)
    # Every survivor saw the same times and the same slow set after every commit.
    for rank in survivors:
        assert [(r.speeds, r.slow) for r in runs[rank].reports] == [
            (r.speeds, r.slow) for r in run.reports]
    ratio = run.reports[4].speeds[SLOW] / run.reports[4].speeds[0]
    assert ratio > 2.5, run.reports[4].speeds  # measured: about 4


def test_without_the_measured_time_in_the_lane_no_work_moves(monkeypatch):
    """A mutation: the trainer sends no time in the commit lane. The policy then never sees the
    slow replica, and the test above would fail on its quotas."""
    mutate(monkeypatch, "megatron_recover/recovery/checks/stragglers.py",
           "return self.slots.encode(core.p.replica, self._seconds_per_microbatch(core))",
           "return self.slots.encode(core.p.replica, None)")
    case = setup(3 * BASE_S)
    runs, world = run_lockstep(case, timeout_s=60)
    check_run(case, runs, world)
    assert quotas(runs[0]) == [4] * ITERATIONS


def test_a_replica_far_slower_is_evicted_and_the_run_stays_exact():
    """Replica 2 takes 6x as long from iteration 3, past --recover-evict-slower-than 4 for the
    window: it is evicted at iteration 4's commit, after its step, and leaves; the others go on
    (a retry round when they see it gone) and every step is the failure-free one."""
    case = setup(5 * BASE_S, evict=4.0)
    runs, world = run_lockstep(case, timeout_s=60)
    assert isinstance(runs[SLOW].error, Straggler), runs[SLOW].error
    assert len(runs[SLOW].reports) == 3  # iteration 4 stepped, then it raised
    survivors = [0, 1, 3]
    assert_failure_free_steps(runs, survivors, ITERATIONS)
    run = runs[0]
    assert [e["event"] for e in run.reports[3].events] == ["straggler"]
    assert run.reports[3].evicted == [SLOW]
    assert run.reports[3].events[0]["ratios"][str(SLOW)] > 4
    assert [e["event"] for e in run.reports[4].events] == ["retry"]
    assert all(sorted(r.quotas) == survivors for r in run.reports[4:])
    assert all(r.invariant_ok for r in run.reports)


def test_the_pass_timer_reads_cuda_events_where_cuda_is(monkeypatch):
    """On CUDA the timer records events on the current stream and waits for the end event
    before reading it (the host returns from a pass before its kernels finish). Here the events
    are the CPU emulation's stand-ins, which record host times; the branch is the CUDA one."""
    import time

    import torch

    from megatron_recover.recovery.round import PassTimer
    from megatron_recover.testing import _cuda_standins

    synchronized = []

    class Event(_cuda_standins.Event):
        def synchronize(self):
            synchronized.append(self)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = PassTimer()
    time.sleep(0.05)
    timer.stop()
    assert isinstance(timer._start, Event) and isinstance(timer._end, Event)
    seconds = timer.seconds()
    assert 0.05 <= seconds < 1.0 and synchronized == [timer._end]
