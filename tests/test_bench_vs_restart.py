"""The accounting of scripts/bench_vs_restart.py and scripts/run_restart_baseline.py on made-up
timelines: failure placement, committed tokens per interval, kept work, the restart phases.

Run: `make test` (or `.venv/bin/python -m pytest tests/test_bench_vs_restart.py`). Pure Python,
no MPI; the benchmark itself is `scripts/bench_vs_restart.py`.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_vs_restart as bench  # noqa: E402  (scripts/ is not a package)
import run_restart_baseline as baseline  # noqa: E402

TOKENS = bench.TOKENS_PER_ITERATION


def test_failures_land_mid_interval_as_in_the_paper():
    assert bench.failure_iterations(8) == [12, 20, 28, 36]
    assert bench.train_iters(8) == 43  # a fifth failure would strike at 44
    assert bench.failure_iterations(2) == [3, 5, 7, 9]


def restart_attempts():
    """N = 2, failure at 5 (resume from 4): the first launch did 1..4, killed as 5 began at
    t=10; down at 11; the relaunch loads 4 in 20..21 and does 5..8, iteration 5 at t=22."""
    first = {"launched": 0.0, "down": 11.0,
             "iterations": [{"time": 1.0 + i, "iteration": i, "loss": 1.0 / i}
                            for i in range(1, 5)],
             "saves": {"2": {"start": 3.1, "end": 3.5, "line_arrived": 3.5},
                       "4": {"start": 5.1, "end": 5.5, "line_arrived": 5.6}},
             "load": {"iteration": 0, "start": 0.5, "end": 0.5},
             "kill": {"iteration": 5, "rank": 7, "pid": 1, "time": 10.0, "iteration_began": 9.9}}
    second = {"launched": 11.0, "down": 40.0,
              "iterations": [{"time": 17.0 + i, "iteration": i, "loss": 1.0 / i}
                             for i in range(5, 9)],
              "saves": {"6": {"start": 23.1, "end": 23.3, "line_arrived": 23.3}},
              "load": {"iteration": 4, "start": 20.0, "end": 21.0}, "kill": None}
    return [first, second]


def test_restart_phases_tile_the_failure_window():
    phases = baseline.breakdown(restart_attempts())[0]
    assert phases["resumed_from"] == 4
    assert phases["checkpoint_save_s"] == pytest.approx(0.4)
    assert phases["run_before_failure_s"] == pytest.approx(4.5)
    assert phases["failure_handling_s"] == pytest.approx(1.0)
    assert phases["restart_initialization_s"] == pytest.approx(9.0)
    assert phases["checkpoint_load_s"] == pytest.approx(1.0)
    assert phases["rerun_s"] == pytest.approx(1.0)  # iteration 5 completes again at t=22
    total = sum(phases[k] for k in bench.RESTART_PHASES)
    assert total == pytest.approx(22.0 - 5.1)  # from the save's start to iteration 5 redone
    assert baseline.output_delay(restart_attempts())["max"] == pytest.approx(0.1)


def test_restart_counts_each_iteration_once():
    timeline = bench.restart_timeline({"attempts": restart_attempts()})
    assert [i for _, i, _ in bench.first_completions(timeline)] == list(range(1, 9))
    kept = bench.last_completions(timeline)
    assert [i for _, i, _ in kept] == list(range(1, 9))
    assert bench.live_processes(timeline, 30.0) == bench.RANKS  # a restart keeps them all
    # Interval 0: end of iteration N=2 (t=3) to the kill (t=10): iterations 3, 4 first done.
    # Interval 1: kill to the end: 5..8 (the redo of nothing: 5 was never completed before).
    intervals = bench.intervals(timeline, 2, 8)
    assert [iv["tokens"] for iv in intervals] == [2 * TOKENS, 4 * TOKENS]
    assert intervals[1]["runtime_s"] == pytest.approx(25.0 - 10.0)
    assert intervals[1]["effective_throughput"] == pytest.approx(
        4 * TOKENS / (15.0 * bench.RANKS))
    # The cumulative curve never counts what a restart discarded: here nothing was redone.
    assert bench.curve(timeline)[-1][1] == 8 * TOKENS


def test_redone_work_counts_once_and_when_kept():
    timeline = {"start": 0.0, "end": 9.0, "failures": [4.0], "processes_lost_per_failure": 0,
                "completions": [(1.0, 1, TOKENS), (2.0, 2, TOKENS), (3.0, 3, TOKENS),
                                (6.0, 2, TOKENS), (7.0, 3, TOKENS), (8.0, 4, TOKENS)]}
    assert [(t, i) for t, i, _ in bench.first_completions(timeline)] == [
        (1.0, 1), (2.0, 2), (3.0, 3), (8.0, 4)]
    assert [(t, i) for t, i, _ in bench.last_completions(timeline)] == [
        (1.0, 1), (6.0, 2), (7.0, 3), (8.0, 4)]
    intervals = bench.intervals(timeline, 1, 4)
    assert [iv["tokens"] for iv in intervals] == [2 * TOKENS, TOKENS]


def test_recover_loses_a_process_per_failure():
    run = {"launched": 0.0, "ended": 10.0,
           "records": [{"iteration": i, "time": float(i), "tokens": TOKENS} for i in range(1, 9)],
           "markers": [{"time": 2.5}, {"time": 5.5}]}
    timeline = bench.recover_timeline(run)
    assert bench.live_processes(timeline, 3.0) == bench.RANKS - 1
    intervals = bench.intervals(timeline, 2, 8)
    assert [iv["tokens"] for iv in intervals] == [0, 3 * TOKENS, 3 * TOKENS]
    assert intervals[2]["effective_throughput"] == pytest.approx(
        3 * TOKENS / (2.5 * (bench.RANKS - 2)))
    # Process-seconds: 8 x 2.5 + 7 x 3 + 6 x 2.5 at t = 8.
    assert bench.process_seconds(timeline, 8.0) == pytest.approx(20.0 + 21.0 + 15.0)


# The fair protocol ---------------------------------------------------------------------------

def test_fair_failures_are_seeded_and_spaced_by_the_mtbf():
    failures = bench.spaced_failures(16, 4, seed=2026)
    assert failures == bench.spaced_failures(16, 4, seed=2026)
    assert failures[0] >= 2 and all(b > a for a, b in zip(failures, failures[1:]))
    assert bench.spaced_train_iters(failures, 16) == failures[-1] + 16
    many = bench.spaced_failures(16, 4000, seed=1)
    assert (many[-1] - 1) / len(many) == pytest.approx(16, rel=0.05)


def test_window_figures_count_each_iteration_once_against_8_processes():
    timeline = bench.restart_timeline({"attempts": restart_attempts()})
    figures = bench.window_figures(timeline, 8)
    # From iteration 1's line (t=2) to iteration 8's (t=25): iterations 2..8 committed.
    assert figures["window_s"] == pytest.approx(23.0)
    assert figures["committed_tokens"] == 7 * TOKENS
    assert figures["tokens_per_s_per_machine"] == pytest.approx(7 * TOKENS / 23.0)
    assert figures["goodput_per_allocated_process"] == pytest.approx(
        7 * TOKENS / (23.0 * bench.RANKS))


def test_restart_costs_tile_the_window():
    result = {"attempts": restart_attempts(), "train_iters": 8}
    timeline = bench.restart_timeline(result)
    figures = bench.window_figures(timeline, 8)
    phases = bench.restart_costs(result, figures, typical_save_s=0.4)
    assert phases["save_s"] == pytest.approx(0.4 + 0.4 + 0.2)
    assert phases["writer_startup_s"] == 0.0  # no first save slower than a later one
    assert phases["lost_work_s"] == pytest.approx(10.0 - 5.5)  # save of 4 ends, kill
    assert phases["detection_s"] == pytest.approx(1.0)
    assert phases["restart_initialization_s"] == pytest.approx(9.0)
    assert phases["checkpoint_load_s"] == pytest.approx(1.0)
    assert phases["redo_s"] == pytest.approx(1.0)
    assert sum(phases.values()) == pytest.approx(figures["window_s"])
    assert phases["training_s"] == pytest.approx(23.0 - 17.5)


def test_lost_work_of_a_launch_that_never_saved_is_its_own_training():
    """A second failure before the relaunch's first save: the relaunch loses what it trained
    after its own load, not what lies between the older checkpoint and its kill."""
    first, second = restart_attempts()
    second = {**second, "down": 30.0, "saves": {},
              "iterations": [{"time": 22.0, "iteration": 5, "loss": 0.2}],
              "kill": {"iteration": 6, "rank": 6, "pid": 2, "time": 23.0,
                       "iteration_began": 22.9}}
    third = {"launched": 30.0, "down": 60.0, "saves": {}, "kill": None,
             "iterations": [{"time": 45.0 + i, "iteration": i, "loss": 1.0 / i}
                            for i in range(5, 9)],
             "load": {"iteration": 4, "start": 40.0, "end": 41.0}}
    result = {"attempts": [first, second, third], "train_iters": 8}
    figures = bench.window_figures(bench.restart_timeline(result), 8)
    phases = bench.restart_costs(result, figures, typical_save_s=0.4)
    assert phases["lost_work_s"] == pytest.approx((10.0 - 5.5) + (23.0 - 21.0))
    assert sum(phases.values()) == pytest.approx(figures["window_s"])
    assert phases["training_s"] > 0


def test_cpu_model_replays_the_restart_accounting():
    from megatron_recover.goodput.cpu_model import restart_window_s

    # Iterations of 1 s, a save every 2 (0.5 s, the launch's first 2 s more), a kill as
    # iteration 4 begins costing 10 s: 2 | save | 3 | kill | 3 4 | save | 5 6.
    assert restart_window_s(iteration_s=1.0, interval=2, train_iters=6, failures=[4],
                            save_s=0.5, writer_startup_s=2.0,
                            failure_cost_s=10.0) == pytest.approx(21.0)
    # Without failures: only the saves between iteration 1 and the end.
    assert restart_window_s(iteration_s=1.0, interval=2, train_iters=6, failures=[],
                            save_s=0.5, writer_startup_s=2.0,
                            failure_cost_s=10.0) == pytest.approx(5 + 2.5 + 0.5)


def test_young_daly_interval_in_iterations():
    n, interval_s = bench.young_daly_n(save_s=0.5, iteration_s=0.4, mtbf_iters=16)
    # Daly's correction shortens Young's sqrt(2 C M) by about C when C << M.
    assert interval_s == pytest.approx((2 * 0.5 * 6.4) ** 0.5 - 0.5, rel=0.1)
    assert n == round(interval_s / 0.4)


def test_a_launch_second_line_gives_no_loss_of_its_own():
    """A restarted stock launch logs every iteration; its second line averages its first
    iteration in (Megatron-LM's first line starts no interval), so it stands for no single
    iteration's loss, and a redo is compared with the first run only where both lines do."""
    line = (" [2026-12-08 01:02:03.456789] iteration {:8d}/      10 | consumed samples: 1 |"
            " lm loss: {} | loss scale: 1.0 |\n")
    out = baseline.StampedOutput([(1.0, line.format(5, "4.000000E+00")),
                                  (2.0, line.format(6, "3.500000E+00")),
                                  (3.0, line.format(7, "2.000000E+00"))])
    assert out.iterations() == [(1.0, 5, 4.0), (2.0, 6, None), (3.0, 7, 2.0)]
    first = {"iterations": [{"iteration": 6, "loss": 3.0}, {"iteration": 7, "loss": 2.0}]}
    redo = {"iterations": [{"iteration": i, "loss": v} for _, i, v in out.iterations()]}
    reference = {"records": [{"iteration": i, "loss": 1.0} for i in (5, 6, 7)]}
    runs = {s: reference for s in ("recover", "adaptive")}
    check = bench.loss_check(runs, reference, {"attempts": [first, redo]})
    assert check["restart_redone_iterations"] == 1  # iteration 7; 6's redo shows no loss
    assert check["restart_redos_differing_from_first_run"] == 0
