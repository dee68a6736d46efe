"""Failure schedules: validation, the seeded generator, the injection report. Pure Python, fast."""

import json

import pytest

from megatron_recover.cli import main as cli
from megatron_recover.faults import schedule as schedule_module
from megatron_recover.faults.injection import read_markers
from megatron_recover.faults.schedule import (
    LOCATIONS,
    FailureSchedule,
    Overflow,
    ScheduledFaults,
    ScheduleEntry,
    StandbyEntry,
    generate_schedule,
    injection_report,
    load_schedule,
    write_schedule,
)


def write(tmp_path, text):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def test_round_trip(tmp_path):
    entries = [ScheduleEntry(3, 1, 0, "during-reduce"), ScheduleEntry(5, 0, 1, "backward")]
    write_schedule(entries, tmp_path / "s.yaml")
    assert load_schedule(tmp_path / "s.yaml", 2, 2, 10) == entries


@pytest.mark.parametrize("entry, message", [
    ("{iteration: 1, replica: 4, local_rank: 0, location: backward}", "replica 4 does not exist"),
    ("{iteration: 1, replica: 0, local_rank: 2, location: backward}", "local_rank 2 does not"),
    ("{iteration: 1, replica: 0, local_rank: 0, location: nowhere}", "location 'nowhere'"),
    ("{iteration: 11, replica: 0, local_rank: 0, location: backward}", "outside 1..10"),
    ("{iteration: 1, replica: 0, location: backward}", "must have the keys"),
    ("{iteration: 1, replica: 0, local_rank: 0, location: backward, action: melt}",
     "action 'melt'"),
    ("{iteration: 1, replica: 0, local_rank: 0, location: backward, action: stall}",
     "'seconds' goes with action stall"),
    ("{iteration: 1, replica: 0, local_rank: 0, location: backward, action: slow, factor: 2}",
     "give it location pre-forward"),
    ("{iteration: 1, replica: 0, local_rank: 0, location: pre-forward, action: slow}",
     "either 'factor'"),
    ("{iteration: 1, replica: 0, local_rank: 0, location: pre-forward, action: slow, "
     "factor: 0.5}", "either 'factor'"),
    ("{iteration: 1, replica: 0, local_rank: 0, location: pre-forward, action: slow, "
     "factor: 2, seconds: 1}", "either 'factor'"),
    ("{iteration: 4, replica: 0, local_rank: 0, location: pre-forward, action: slow, "
     "factor: 2, until: 3}", "'until' must be in 4..10"),
    ("{iteration: 1, replica: 0, local_rank: 0, location: backward, until: 3}",
     "'factor' and 'until' go with action slow"),
])
def test_bad_entries_name_the_problem(tmp_path, entry, message):
    with pytest.raises(ValueError, match=message):
        load_schedule(write(tmp_path, f"entries:\n  - {entry}\n"), 4, 2, 10)


def overflows(path, b_at=lambda t: 8):
    return FailureSchedule.load(path, 4, 1, 10, b_at).overflows


def test_overflows(tmp_path):
    path = write(tmp_path, "entries: []\noverflows:\n  - {iteration: 3, microbatch_id: 5}\n")
    assert load_schedule(path, 4, 1, 10) == []
    assert overflows(path) == (Overflow(3, 5),)
    ramp = {1: 2, 2: 4, 3: 4}  # a batch-size ramp-up: iteration 3 has ids 0..3 only
    with pytest.raises(ValueError, match=r"microbatch_id must be in 0..3 \(the ids of iteration 3"):
        overflows(path, lambda t: ramp.get(t, 8))
    assert overflows(write(tmp_path, "entries: []\n")) == ()
    for bad, message in (("{iteration: 3, microbatch_id: 8}", "microbatch_id must be in 0..7"),
                         ("{iteration: 0, microbatch_id: 1}", "iteration must be in 1..10"),
                         ("{iteration: 3}", "exactly the keys")):
        with pytest.raises(ValueError, match=message):
            overflows(write(tmp_path, f"entries: []\noverflows:\n  - {bad}\n"))


def test_one_read_holds_every_part(tmp_path):
    schedule = FailureSchedule.load(write(tmp_path, (
        "entries:\n  - {iteration: 2, replica: 1, local_rank: 0, location: backward}\n"
        "standbys:\n  - {standby: 0, location: idle}\n"
        "overflows:\n  - {iteration: 3, microbatch_id: 1}\n"
        "bad_samples:\n  - {iteration: 4, microbatch_id: 2}\n"
        "slow_snapshot_writes:\n  - {iteration: 6, seconds: 1.5}\n")), 2, 1, 10,
        lambda t: 4, standbys=1)
    assert schedule.entries == (ScheduleEntry(2, 1, 0, "backward"),)
    assert schedule.standbys == (StandbyEntry(0, "idle"),)
    assert (schedule.overflows, schedule.bad_samples) == ((Overflow(3, 1),), (Overflow(4, 2),))
    assert schedule.slow_snapshot_writes == {6: 1.5}
    for part, message in (("standbys:\n  - {standby: 1, location: idle}\n", "standby 1 does not"),
                          ("bad_samples:\n  - {iteration: 4, microbatch_id: 4}\n",
                           "bad sample 0: microbatch_id must be in 0..3"),
                          ("slow_snapshot_writes:\n  - {iteration: 11, seconds: 1}\n",
                           "iterations in 1..10")):
        with pytest.raises(ValueError, match=message):
            FailureSchedule.load(write(tmp_path, "entries: []\n" + part), 2, 1, 10, lambda t: 4,
                                 standbys=1)


def test_a_slow_rank_sleeps_in_its_iterations_and_marks_the_start(tmp_path, monkeypatch):
    """Action slow: passes in iterations 3..4 take `factor` times as long (the sleep after a
    pass), and one marker says when it started; a slowed rank may also die later."""
    path = write(tmp_path, "entries:\n"
                 "  - {iteration: 3, replica: 1, local_rank: 0, location: pre-forward, "
                 "action: slow, factor: 3, until: 4}\n"
                 "  - {iteration: 6, replica: 1, local_rank: 0, location: backward}\n")
    entries = load_schedule(path, 2, 1, 10)
    faults = ScheduledFaults(entries, 1, 0, world_rank=1, marker_path=tmp_path / "markers")
    slept = []
    monkeypatch.setattr(schedule_module.time, "sleep", slept.append)
    assert faults.at("pre-forward", 3) is False  # not a kill
    for iteration in (2, 3, 3, 4, 5):
        faults.slow_down(iteration, 4, lambda: 0.5)
    assert slept == [1.0, 1.0, 1.0]
    markers = read_markers(tmp_path / "markers")
    assert [(m["iteration"], m["action"], m["factor"]) for m in markers] == [(3, "slow", 3.0)]
    extra = ScheduledFaults(load_schedule(write(tmp_path, (
        "entries:\n  - {iteration: 2, replica: 0, local_rank: 0, location: pre-forward, "
        "action: slow, seconds: 0.25}\n")), 2, 1, 10), 0, 0, 0, tmp_path / "m2")
    slept.clear()
    extra.slow_down(9, 4, lambda: 0.5)
    assert slept == [1.0]  # 0.25 s per microbatch, to the end of the run


def test_a_rank_dies_once(tmp_path):
    entry = "{iteration: 1, replica: 0, local_rank: 0, location: backward}"
    with pytest.raises(ValueError, match="only once"):
        load_schedule(write(tmp_path, f"entries:\n  - {entry}\n  - {entry}\n"), 4, 1, 10)


def test_generator_is_seeded_and_keeps_a_survivor():
    a = generate_schedule(8, 2, 7, seed=3, first_iteration=2, last_iteration=9)
    assert a == generate_schedule(8, 2, 7, seed=3, first_iteration=2, last_iteration=9)
    assert a != generate_schedule(8, 2, 7, seed=4, first_iteration=2, last_iteration=9)
    assert len({e.replica for e in a}) == 7
    assert all(2 <= e.iteration <= 9 and e.location in LOCATIONS and e.local_rank < 2 for e in a)
    with pytest.raises(ValueError, match="every one"):
        generate_schedule(4, 1, 4, seed=0, first_iteration=1, last_iteration=2)


def test_injection_report_uses_the_victims_markers(tmp_path):
    entries = [ScheduleEntry(3, 1, 0, "during-reduce"), ScheduleEntry(5, 2, 0,
                                                                     "during-extension")]
    markers = tmp_path / "m.jsonl"
    markers.write_text(json.dumps({"point": "reduce", "rank": 1, "time": 0.0, "iteration": 3,
                                   "location": "during-reduce"}) + "\n")
    report = injection_report(entries, markers, {(r, 0): r for r in range(4)})
    assert [e["replica"] for e in report["injected"]] == [1]
    assert [e["replica"] for e in report["not_injected"]] == [2]


def test_cli_writes_the_schedule(tmp_path, capsys):
    out = tmp_path / "faults.yaml"
    assert cli(["schedule", "--replicas", "8", "--seed", "1", "--count", "3", "--iterations",
                "4:20", "--locations", "during-reduce", "backward", "-o", str(out)]) == 0
    entries = load_schedule(out, 8, 1, 20)
    assert len(entries) == 3 and {e.location for e in entries} <= {"during-reduce", "backward"}
    assert cli(["schedule", "--replicas", "2", "--seed", "1", "--count", "2", "--iterations",
                "1:2", "-o", str(out)]) == 2
    assert "every one of 2 replicas" in capsys.readouterr().err


def test_a_checkpoint_save_entry_needs_a_save_after_its_iteration():
    """A save follows every --save-interval iteration, the last, and the --exit-interval stop
    (at its first multiple, as Megatron-LM stops); an entry elsewhere would never fire and is
    refused at start-up."""
    from megatron_recover.megatron.config.arguments import parse_args
    from megatron_recover.megatron.app.run import _unreached

    cfg = parse_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                     "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 8 "
                     "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 100 --recover "
                     "--save d --save-interval 4 --exit-interval 3".split(), world_size=4,
                     cuda_available=False)
    assert [t for t in range(1, 11) if _unreached(cfg, "checkpoint-save", t) is None] == [
        3, 4, 8, 10]
    assert "no save follows it (--save d, --save-interval 4, --exit-interval 3" in _unreached(
        cfg, "checkpoint-save", 5)
