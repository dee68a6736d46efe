"""The goodput simulator and the ETTR definition (pure Python: no MPI, no torch)."""

import json
import random
import subprocess
import sys
from dataclasses import asdict

import pytest

from megatron_recover.goodput import anchors
from megatron_recover.goodput import simulator as sim
from megatron_recover.goodput.ettr import Allocation, ettr, goodput

SMALL = sim.Job(gpus=64, gpus_per_replica=8, iteration_s=2.0, microbatches_per_replica=8,
                tokens_per_microbatch=100)


def test_allocation_counts_dead_processes_until_replaced():
    # 8 processes for 10 s, then 6 (two released) for 5 s: 110 process-seconds.
    held = Allocation(0.0, 15.0, ((0.0, 8), (10.0, 6)))
    assert held.process_seconds() == 8 * 10 + 6 * 5
    assert goodput(1100.0, held) == 10.0
    assert ettr(1100.0, held, 20.0) == 0.5
    with pytest.raises(ValueError):
        Allocation(1.0, 2.0, ((0.0, 1),))


def test_deterministic_for_a_seed():
    model = sim.FailureModel(job_mtbf_s_override=600.0, hang_share=0.2)
    runs = [sim.simulate(SMALL, model, sim.Costs(), 20_000.0, seed=7) for _ in range(2)]
    assert {s: asdict(r) for s, r in runs[0].items()} == {s: asdict(r) for s, r in runs[1].items()}
    other = sim.simulate(SMALL, model, sim.Costs(), 20_000.0, seed=8)
    assert other["recover"].failures != runs[0]["recover"].failures or \
        other["recover"].committed_tokens != runs[0]["recover"].committed_tokens


def test_no_failures_leaves_only_the_checkpoint_overhead():
    costs = sim.Costs(checkpoint_save_s=3.0, memory_save_s=0.5)
    horizon = 10_000.0
    results = sim.simulate(SMALL, sim.FailureModel(job_mtbf_s_override=1e9), costs, horizon,
                           seed=1, trace=(), interval=10, standbys=2, regrow_s=1000.0)
    period = 10 * SMALL.iteration_s
    # Whole periods of 10 iterations and a save, then as many iterations as fit.
    for system, save in (("checkpoint-restart", 3.0), ("in-memory-restart", 0.5)):
        full, rest = divmod(horizon, period + save)
        iterations = full * 10 + min(10, rest // SMALL.iteration_s)
        assert results[system].ettr(SMALL) == pytest.approx(
            iterations * SMALL.iteration_s / horizon, abs=1e-12)
        assert results[system].ettr(SMALL) == pytest.approx(period / (period + save), abs=3e-3)
    whole = (horizon // SMALL.iteration_s) * SMALL.iteration_s / horizon
    assert results["recover"].ettr(SMALL) == pytest.approx(whole)
    assert results["recover+restarts"].ettr(SMALL) == pytest.approx(whole)
    assert results["drop-and-go"].ettr(SMALL) == pytest.approx(whole)
    # Standbys are allocated: 8 training replicas out of 10 held.
    assert results["recover+standbys"].ettr(SMALL) == pytest.approx(whole * 8 / 10)


def test_adding_a_failure_never_raises_ettr():
    lowered = pairs = 0
    for case in range(150):
        rng = random.Random(case)
        job = sim.Job(gpus=rng.choice([4, 8, 16]) * 8, gpus_per_replica=8,
                      iteration_s=rng.choice([1.0, 3.0, 7.0]),
                      microbatches_per_replica=rng.choice([1, 4, 8]), tokens_per_microbatch=10)
        horizon = rng.uniform(500, 5000)
        costs = sim.Costs(detection_s=rng.uniform(0, 20), restart_init_s=rng.uniform(0, 100),
                          checkpoint_save_s=rng.uniform(0, 10),
                          checkpoint_load_s=rng.uniform(0, 20), join_s=rng.uniform(0, 30),
                          replace_s=rng.uniform(10, 1000),
                          recover_hang_timeout_s=rng.uniform(0, 60),
                          hang_timeout_s=rng.uniform(0, 200))
        trace = sim.failure_trace(rng.uniform(50, 800), 0.3, horizon, case)
        extra = sim.Failure(rng.uniform(0, horizon), rng.random() < 0.3)
        more = tuple(sorted(trace + (extra,), key=lambda f: f.time_s))
        model = sim.FailureModel(job_mtbf_s_override=300.0)
        interval = rng.choice([None, 1, 5, 20])
        regrow = rng.choice([None, 300.0])  # recover+restarts, excluded below
        before = sim.simulate(job, model, costs, horizon, 0, trace=trace, standbys=2,
                              interval=interval, regrow_s=regrow)
        after = sim.simulate(job, model, costs, horizon, 0, trace=more, standbys=2,
                             interval=interval, regrow_s=regrow)
        for system in before:
            if system == "recover+restarts":  # a reset policy: see the simulator's docstring
                continue
            # A join lands at the next iteration boundary, which an extra failure can move:
            # recover+standbys holds to within one iteration's tokens.
            slack = 1e-12 if system != "recover+standbys" else job.tokens_per_iteration / (
                before[system].allocation.process_seconds() * job.failure_free_tokens_per_gpu_s)
            assert after[system].ettr(job) <= before[system].ettr(job) + slack, (case, system)
            lowered += after[system].ettr(job) < before[system].ettr(job)
            pairs += 1
    # The added failure did cost something almost everywhere (not where the run had already
    # ended, or a late failure only delayed an uncounted iteration).
    assert lowered > 0.8 * pairs, (lowered, pairs)


def test_a_fixed_stall_keeps_one_minus_stall_over_mtbf():
    """The published figures' accounting: each failure costs its stall, costs add up."""
    job = sim.Job(gpus=64, gpus_per_replica=8, iteration_s=1.0)
    costs = sim.Costs(detection_s=0.0, hang_timeout_s=0.0, restart_init_s=60.0,
                      checkpoint_save_s=0.0, checkpoint_load_s=0.0)
    model = sim.FailureModel(job_mtbf_s_override=300.0)
    runs = [sim.simulate(job, model, costs, 200_000.0, seed, systems=("checkpoint-restart",),
                         interval=1) for seed in range(3)]
    mean = sum(r["checkpoint-restart"].ettr(job) for r in runs) / len(runs)
    assert mean == pytest.approx(1 - 60.0 / 300.0, abs=0.02)


def test_recover_keeps_the_batch_and_drop_and_go_loses_it():
    trace = (sim.Failure(100.5), sim.Failure(300.5))
    results = sim.simulate(SMALL, sim.FailureModel(job_mtbf_s_override=1e9), sim.Costs(),
                           1000.0, 0, trace=trace, systems=("recover", "drop-and-go"))
    recover, drop = results["recover"], results["drop-and-go"]
    assert recover.live_replicas[-1][1] == drop.live_replicas[-1][1] == 6
    # Recover's tokens are whole iterations of B; drop-and-go commits fewer microbatches.
    assert recover.committed_tokens % SMALL.tokens_per_iteration == 0
    assert drop.committed_tokens % SMALL.tokens_per_iteration != 0


def test_planned_restarts_bring_a_shrinking_job_back_to_full_size():
    trace = (sim.Failure(100.5), sim.Failure(300.5))
    model = sim.FailureModel(job_mtbf_s_override=1e9)
    kept = sim.simulate(SMALL, model, sim.Costs(), 20_000.0, 0, trace=trace,
                        systems=("recover",))["recover"]
    regrown = sim.simulate(SMALL, model, sim.Costs(), 20_000.0, 0, trace=trace,
                           systems=("recover+restarts",), regrow_s=1000.0)["recover+restarts"]
    assert kept.live_replicas[-1][1] == 6
    # Back to 8 at the first planned restart after the failures (t = 1000, plus its cost).
    assert regrown.live_replicas[-1] == (pytest.approx(1000.0 + sim.planned_restart_s(
        sim.Costs()), abs=SMALL.iteration_s * 2), 8)
    assert regrown.ettr(SMALL) > kept.ettr(SMALL)


def test_young_daly_interval():
    # Young's first-order sqrt(2 C M), with Daly's correction for C << M.
    assert sim.young_daly_interval_s(10.0, 10_000.0) == pytest.approx(
        (2 * 10 * 10_000) ** 0.5, rel=0.02)
    assert sim.young_daly_interval_s(30.0, 10.0) == 10.0


def test_costs_from_a_recovery_log(tmp_path):
    log = tmp_path / "log.jsonl"
    records = [{"iteration": 1, "B": 32, "live_replicas": 8, "iteration_ms": 400.0,
                "events": []},
               {"iteration": 2, "B": 32, "live_replicas": 7, "iteration_ms": 900.0,
                "events": [{"event": "failure", "detected": 10.3, "restored": 10.5}]}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    log.with_suffix(".markers.jsonl").write_text(json.dumps({"time": 10.0}) + "\n")
    costs, measured = anchors.costs_from_log(log, sim.Costs())
    assert costs.recover_restore_s == pytest.approx(0.2)
    assert costs.recover_detection_s == pytest.approx(0.3)
    assert measured["iteration_s"] == 0.4 and measured["microbatches"] == 32


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "megatron_recover.cli", "goodput", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def test_validate_prints_one_line_per_anchor(tmp_path):
    done = cli("--validate", "--json", "--bench-summary", str(tmp_path / "missing.json"))
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["name"] for line in lines] == ["llama3-16k", "hsdp-100k-10min",
                                                "hsdp-100k-3min", "cpu-benchmark"]
    for line in lines:
        assert set(line) >= {"name", "target", "simulated", "tolerance", "ok"}
    assert all(line["ok"] for line in lines[:3]), lines
    assert not lines[3]["ok"] and "no benchmark summary" in lines[3]["note"]
    assert done.returncode == 1  # not every anchor holds without the benchmark


def test_goodput_json_and_bad_input():
    done = cli("--gpus", "16000", "--runs", "1", "--days", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    systems = report["results"][0]["systems"]
    assert set(systems) == set(sim.SYSTEMS)
    assert 0 < systems["checkpoint-restart"]["ettr"] <= 1
    bad = cli("--gpus", "64", "--gpus-per-replica", "128")
    assert bad.returncode == 2 and "hold no replica" in bad.stderr


def test_cpu_benchmark_anchor_predicts_from_the_summary(tmp_path):
    inputs = {"fit_N": [2, 4], "held_out_N": 8, "iteration_s": 0.5, "train_iters": 40,
              "failures": [10, 25], "save_s": 0.8, "writer_startup_s": 12.0,
              "failure_cost_s": 20.0, "kill_offset_s": 0.0, "committed_tokens": 39 * 2048,
              "recover_tokens_per_s": 3000.0}
    from megatron_recover.goodput.cpu_model import predict_ratio, restart_window_s

    window = restart_window_s(iteration_s=0.5, interval=8, train_iters=40, failures=[10, 25],
                              save_s=0.8, writer_startup_s=12.0, failure_cost_s=20.0)
    predicted = 3000.0 / (39 * 2048 / window)
    assert predict_ratio(inputs) == pytest.approx(predicted)
    for measured, ok in ((predicted * 1.1, True), (predicted * 1.5, False)):
        path = tmp_path / f"summary-{ok}.json"
        path.write_text(json.dumps({"simulator_inputs": {**inputs,
                                                         "measured_ratio_held_out": measured}}))
        line = anchors.cpu_benchmark(path)
        assert line["ok"] is ok and line["target"] == measured, line


def test_every_anchor_holds_on_the_recorded_benchmark(tmp_path):
    """Without a fresh runs/bench/summary.json the cpu-benchmark anchor reads the recorded run
    (docs/results), so `--validate` holds on a clean checkout."""
    done = cli("--validate", "--json", cwd=tmp_path)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0 and all(line["ok"] for line in lines), lines
    assert "docs/results/bench_vs_restart.json" in lines[3]["source"]
