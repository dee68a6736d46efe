"""The pure parts of scripts/bench_scale.py: the failure plan and the checks on a run's log.

Run: `make test` (or `.venv/bin/python -m pytest tests/test_bench_scale.py`). Pure Python, no MPI;
the scale run itself is `scripts/bench_scale.py`.
"""

import sys
from pathlib import Path

import pytest

from megatron_recover.faults.schedule import (
    ITERATION_LOCATIONS,
    load_schedule,
    write_schedule,
)
from megatron_recover.policy import PolicyConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_scale  # noqa: E402  (scripts/ is not a package)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_plan_kills_half_through_every_case(tmp_path, seed):
    config = PolicyConfig(32, 2)
    plan, iterations = bench_scale.plan_failures(config, 16, seed)
    victims = [p.entry.replica for p in plan]
    assert len(victims) == len(set(victims)) == 16
    assert {p.entry.location for p in plan} == set(ITERATION_LOCATIONS)
    assert any(p.effect == bench_scale.BOUNDARY for p in plan)
    assert any(p.effect == bench_scale.PROMOTION for p in plan)
    assert any(p.role in bench_scale.SPARE_ROLES for p in plan)
    assert all(p.record_iteration <= iterations for p in plan)
    # The run refuses schedules it cannot follow: this one must load.
    path = tmp_path / "schedule.yaml"
    write_schedule([p.entry for p in plan], path)
    assert load_schedule(path, 32, 1, iterations) == [p.entry for p in plan]


def test_the_plan_leaves_a_survivor():
    with pytest.raises(ValueError, match="one replica survives"):
        bench_scale.plan_failures(PolicyConfig(4, 2), 4, 0)


def _record(iteration, contributions=8, checksum=1, ok=True, events=()):
    return {"iteration": iteration, "loss": 2.0, "contributions": contributions, "B": 8,
            "ledger_checksum": checksum, "invariant_ok": ok,
            "ledger_problems": [] if ok else ["ids missing: [3]"], "events": list(events)}


def test_invariant_checks_can_fail():
    reference = [_record(1), _record(2)]
    assert bench_scale.invariant_violations(reference, reference) == []
    broken = [_record(1, contributions=7, ok=False), _record(2, checksum=5)]
    problems = bench_scale.invariant_violations(broken, reference)
    assert any("7 contributions" in p for p in problems)
    assert any("ids missing" in p for p in problems)
    assert any("vs reference" in p for p in problems)


def test_replay_flags_a_run_that_left_the_policy():
    config = PolicyConfig(4, 2)
    event = {"event": "failure", "replicas": [3], "g_ext": 1, "promotions": [],
             "detected": 10.5, "restored": 10.75, "committed": 11.0}
    deaths, disagreements = bench_scale.replay(config, [_record(1, events=[event])])
    assert disagreements == []
    assert [(d["replica"], d["role"], d["effect"]) for d in deaths] == [(3, "major", "boundary")]
    rows = bench_scale.recovery_times(deaths, [{"rank": 3, "time": 10.0, "location": "backward"}])
    assert (rows[0]["detected_s"], rows[0]["restored_s"], rows[0]["committed_s"]) == (
        0.5, 0.75, 1.0)
    wrong = dict(event, g_ext=0)
    _, disagreements = bench_scale.replay(config, [_record(1, events=[wrong])])
    assert disagreements
