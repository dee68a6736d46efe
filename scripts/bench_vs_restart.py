"""Effective throughput under successive failures: megatron-recover vs drop-and-go vs
checkpoint-restart, on a tiny GPT on the CPU (8 replicas of one rank each, 2 cores).

Usage: .venv/bin/python scripts/bench_vs_restart.py [--json] [--out runs/bench]
       [--mtbf-iters 16] [--seed 2026] [--paper-intervals 2,4,8,16] [--reuse]

--reuse recomputes the summary and figures from the runs recorded under --out (each run's
timeline.json, checked to be the run asked for) and runs only the ones not recorded.

The systems:
  recover   --recover (static policy, exact mode); the victim dies inside a bucket's all-reduce
            (location during-reduce) and the survivors go on
  adaptive  --recover --recover-policy adaptive (drop-and-go), same failures
  restart   stock Megatron with megatron-core distributed checkpoints every N iterations, its
            data parallelism over the ulfm backend (MPI; recover's default data plane is torch,
            gloo here, which is slower on one host: the difference favours restart; a death
            stops it: the backend fails stop), killed and relaunched by
            scripts/run_restart_baseline.py (the kill lands as the iteration begins, see there)

1. The fair protocol (the headline). 4 failures at iterations drawn once from a seeded
   exponential spacing of mean --mtbf-iters, the same for every system and every N. Restart
   runs first at N = 4; its later saves give the checkpoint cost C, and Young/Daly's interval
   for C and the failure spacing gives N_YD; restart is then swept over N_YD / 2, N_YD and
   2 N_YD as well, and twice the largest N while the largest is the best (at most twice), so
   that the baseline is reported at its best interval. Figures over the window from the end of
   iteration 1 to the first completion of the last iteration:
   - per machine: committed tokens per second (an iteration counts once; drop-and-go counts
     the microbatches it committed). Against allocated capacity (`goodput.ettr`): every system
     holds 8 processes throughout (a dead process stays allocated: nothing replaces it; a
     restart relaunches all 8), so per allocated process gives the same ratio.
   - ETTR: goodput over a failure-free stock run's.
   - phases: restart's save, writer start-up (a launch's first save starts megatron-core's
     writer helper), lost work (from the checkpoint resumed from to the kill), detection
     (kill to the job down), restart initialization, load, redo, training; recover's
     detection + repair, restore, training.
   - simulator_inputs: the event costs measured at every N but the largest, which the goodput
     simulator's cpu-benchmark anchor uses to predict the largest N's ratio.
   A failure-free --recover run is the loss reference.
2. The paper's protocol, for comparison with its 2.23x (its Figure 8 and appendix A.1). For each
   N in --paper-intervals, failure k at iteration round((k + 0.5) N), i.e. 1.5N, 2.5N, ...; the
   run ends after iteration round(5.5N) - 1. The spacing grows with N, so restart's figure
   improves with N without bound: this table is not a fair "best restart".
   - effective throughput of a failure interval = committed tokens / (interval runtime x live
     processes), the paper's definition; interval 0 runs from the end of iteration N to the
     first failure, interval k from failure k to failure k + 1 (or the end). Restart keeps all
     8 processes; recover loses one per failure. Also per machine (live processes left out).
   - cumulative committed tokens vs process-hours (an iteration counts when it completes for
     the last time: work a restart discards never counts).
   - single-failure breakdown (failure 1, at 1.5N): restart phases of appendix A.1, and
     recover's run before the failure, detection + repair, restore (extension pass), commit.
The biases left in are listed in the summary's `bias`.
Writes OUT/summary.json (also printed with --json), the figures OUT/fig_fair_per_machine.png,
OUT/fig8a_throughput_per_interval.png, OUT/fig8b_tokens_vs_process_hours.png,
OUT/fig8c_breakdown_vs_N.png and OUT/fig7_loss_and_throughput.png, and each run's records under
OUT/fair/<system>/ and OUT/N<n>/<system>/.
"""

import argparse
import json
import os
import shutil
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from megatron_recover.faults import read_markers  # noqa: E402
from megatron_recover.goodput.ettr import Allocation, goodput  # noqa: E402
from megatron_recover.goodput.simulator import young_daly_interval_s  # noqa: E402
from megatron_recover.faults.schedule import ScheduleEntry, write_schedule  # noqa: E402
from megatron_recover.launch import LaunchConfig, launch  # noqa: E402
from run_restart_baseline import (  # noqa: E402
    ENTRY,
    BaselineConfig,
    StampedOutput,
    breakdown,
    run_baseline,
)

RANKS = 8
FAILURES = 4
LAYERS, HIDDEN, HEADS, SEQ_LENGTH = 2, 256, 4, 64
GLOBAL_BATCH = 4 * RANKS  # B = 32 microbatches of one sequence: G_init = 4
TOKENS_PER_ITERATION = GLOBAL_BATCH * SEQ_LENGTH
RUN_TIMEOUT_S = 600
SYSTEMS = ("recover", "adaptive", "restart")
RESTART_PHASES = ("checkpoint_save_s", "run_before_failure_s", "failure_handling_s",
                  "restart_initialization_s", "checkpoint_load_s", "rerun_s")
RECOVER_PHASES = ("run_before_failure_s", "detection_and_repair_s", "restore_s", "commit_s")


def job_arguments(data_dir: Path) -> list[str]:
    """The job: ~0.4 s per iteration on 8 processes and 2 cores, on the demo's corpus (Megatron
    .bin/.idx, a 512-token BPE). The learning-rate schedule is fixed (not tied to
    --train-iters), as a long run's would be. ~1.6M parameters in 4 gradient buckets, so a
    failure inside the second bucket's reduce leaves the iteration partially reduced."""
    return ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
            "--num-attention-heads", str(HEADS),
            "--eval-iters", "0",
            "--seq-length", str(SEQ_LENGTH),
            "--max-position-embeddings", str(SEQ_LENGTH), "--micro-batch-size", "1",
            "--global-batch-size", str(GLOBAL_BATCH), "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-decay-style", "cosine", "--lr-decay-iters", "200", "--lr-warmup-iters", "2",
            "--weight-decay", "0.01", "--clip-grad", "1.0", "--hidden-dropout", "0.1",
            "--attention-dropout", "0.1", "--seed", "1234",
            "--data-path", str(data_dir / "corpus_text_document"), "--split", "100,0,0",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(data_dir / "vocab.json"),
            "--merge-file", str(data_dir / "merges.txt"), "--overlap-grad-reduce",
            "--ddp-bucket-size", "500000", "--log-interval", "1"]


def half_up(x: float) -> int:
    return int(x + 0.5)


def failure_iterations(n: int) -> list[int]:
    return [half_up((k + 0.5) * n) for k in range(1, FAILURES + 1)]


def train_iters(n: int) -> int:
    return half_up((FAILURES + 1.5) * n) - 1


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

REUSE = {"on": False}  # --reuse: read the runs recorded under OUT instead of running them


def recorded(run_dir: Path, matches) -> dict | None:
    """With --reuse, the run recorded in run_dir (its timeline.json), which must be the run
    asked for (`matches(timeline)`); None when it is to be run (no --reuse, or not recorded)."""
    path = run_dir / "timeline.json"
    if not REUSE["on"] or not path.exists():
        return None
    timeline = json.loads(path.read_text())
    if not matches(timeline):
        raise SystemExit(f"--reuse: {path} records another run than this one asks for")
    return timeline


def run_recover(run_dir: Path, job: list[str], iterations: int, extra: list[str],
                failures: list[int] | None) -> dict:
    """One --recover run; its iteration lines (stamped), records and victims' markers."""
    kept = recorded(run_dir, lambda t: t["records"][-1]["iteration"] == iterations and sorted(
        m["iteration"] for m in t["markers"]) == sorted(failures or []))
    if kept is not None:
        return kept
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir / "log.jsonl"
    command = [*ENTRY, *job, "--train-iters", str(iterations), "--recover",
               "--recover-log", str(log), *extra]
    if failures:
        # Replicas 7, 6, 5, 4 die, each inside its second bucket's all-reduce.
        schedule = run_dir / "schedule.yaml"
        write_schedule([ScheduleEntry(f, RANKS - 1 - k, 0, "during-reduce")
                        for k, f in enumerate(failures)], schedule)
        command += ["--recover-failure-schedule", str(schedule)]
    launched = time.time()
    result = launch(LaunchConfig(RANKS, command, run_dir / "status", RUN_TIMEOUT_S))
    ended = time.time()
    output = StampedOutput(result.lines)
    (run_dir / "output.txt").write_text(output.text())
    if not result.succeeded:
        raise SystemExit(f"{run_dir}: the run failed (see output.txt)")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    markers = read_markers(log.with_suffix(".markers.jsonl")) if failures else []
    if failures and sorted(m["iteration"] for m in markers) != failures:
        raise SystemExit(f"{run_dir}: failures {failures} scheduled, markers say {markers}")
    run = {"launched": launched, "ended": ended,
           "iterations": [{"time": t, "iteration": i} for t, i, _ in output.iterations()],
           "records": records, "markers": sorted(markers, key=lambda m: m["time"])}
    (run_dir / "timeline.json").write_text(json.dumps(run, indent=1) + "\n")
    return run


def run_restart(run_dir: Path, job: list[str], n: int, progress,
                failures: list[int] | None = None, iterations: int | None = None) -> dict:
    """Stock Megatron, its data parallelism over ulfm like --recover's (a death stops it: the
    backend fails stop), checkpointing every n iterations; the paper's failures unless given."""
    failures = failure_iterations(n) if failures is None else failures
    iterations = train_iters(n) if iterations is None else iterations
    kept = recorded(run_dir, lambda t: (t["failures"], t["train_iters"], t["save_interval"])
                    == (failures, iterations, n))
    if kept is not None:
        return kept
    shutil.rmtree(run_dir, ignore_errors=True)
    result = run_baseline(BaselineConfig(ranks=RANKS, job=job, train_iters=iterations,
                                         save_interval=n, failures=failures, out=run_dir,
                                         attempt_timeout_s=RUN_TIMEOUT_S,
                                         cross_replica_backend="ulfm"),
                          progress=progress)
    shutil.rmtree(run_dir / "checkpoints")  # tens of MB each; the timeline is what we keep
    return result


# ---------------------------------------------------------------------------------------------
# Timelines: completions (time, iteration, tokens), failure times, live processes
# ---------------------------------------------------------------------------------------------

def recover_timeline(run: dict) -> dict:
    """Completions by the records' own clock (the writer stamps each after its commit)."""
    seen = [(r["time"], r["iteration"], r["tokens"]) for r in run["records"]]
    return {"start": run["launched"], "end": run["ended"], "completions": seen,
            "failures": [m["time"] for m in run["markers"]], "processes_lost_per_failure": 1}


def restart_timeline(result: dict) -> dict:
    seen = [(c["time"], c["iteration"], TOKENS_PER_ITERATION)
            for attempt in result["attempts"] for c in attempt["iterations"]]
    return {"start": result["attempts"][0]["launched"], "end": result["attempts"][-1]["down"],
            "completions": sorted(seen),
            "failures": [a["kill"]["time"] for a in result["attempts"] if a["kill"]],
            "processes_lost_per_failure": 0}


def live_processes(timeline: dict, t: float) -> int:
    lost = sum(1 for f in timeline["failures"] if f <= t)
    return RANKS - lost * timeline["processes_lost_per_failure"]


def first_completions(timeline: dict) -> list[tuple[float, int, int]]:
    """Each iteration when the run first completed it (redone iterations add nothing)."""
    out, furthest = [], 0
    for t, iteration, tokens in timeline["completions"]:
        if iteration > furthest:
            out.append((t, iteration, tokens))
            furthest = iteration
    return out


def last_completions(timeline: dict) -> list[tuple[float, int, int]]:
    """Each iteration when the run completed it for the last time (the work that was kept)."""
    last = {}
    for t, iteration, tokens in timeline["completions"]:
        last[iteration] = (t, iteration, tokens)
    return sorted(last.values())


def completion_time(timeline: dict, iteration: int) -> float:
    return next(t for t, i, _ in first_completions(timeline) if i == iteration)


def intervals(timeline: dict, n: int, iterations: int) -> list[dict]:
    """Interval 0: end of iteration N to failure 1; interval k: failure k to k + 1 (or end)."""
    bounds = [completion_time(timeline, n), *timeline["failures"],
              completion_time(timeline, iterations)]
    credited = first_completions(timeline)
    out = []
    for k, (start, end) in enumerate(zip(bounds, bounds[1:])):
        tokens = sum(tok for t, _, tok in credited if start < t <= end)
        live = live_processes(timeline, start)
        runtime = end - start
        out.append({"interval": k, "runtime_s": runtime, "live_processes": live,
                    "tokens": tokens, "tokens_per_s": tokens / runtime,
                    "effective_throughput": tokens / (runtime * live)})
    return out


def curve(timeline: dict) -> list[tuple[float, int]]:
    """(process-hours, cumulative kept tokens) at each kept completion."""
    points, total = [(0.0, 0)], 0
    for t, _, tokens in last_completions(timeline):
        total += tokens
        points.append((process_seconds(timeline, t) / 3600, total))
    return points


def process_seconds(timeline: dict, t: float) -> float:
    edges = [timeline["start"], *[f for f in timeline["failures"] if f < t], t]
    return sum((b - a) * live_processes(timeline, a) for a, b in zip(edges, edges[1:]))


def recover_breakdown(run: dict, timeline: dict, n: int, failure: int) -> dict:
    """Failure 1 of a recover run: from the end of iteration N to the end of iteration 1.5N."""
    event = next(e for r in run["records"] if r["iteration"] == failure for e in r["events"]
                 if e["event"] == "failure")
    killed = run["markers"][0]["time"]
    start = completion_time(timeline, n)
    end = completion_time(timeline, failure)
    return {"run_before_failure_s": killed - start, "detection_and_repair_s":
            event["detected"] - killed, "restore_s": event["restored"] - event["detected"],
            "commit_s": end - event["restored"], "total_s": end - start}


def restart_breakdown(result: dict) -> dict:
    """Failure 1 of a restart run: the phases tile the save at N .. iteration 1.5N redone."""
    first = result["breakdown"][0]
    phases = {k: first[k] for k in RESTART_PHASES}
    phases["total_s"] = sum(phases.values())
    phases["kill_after_iteration_began_s"] = first["kill_after_iteration_began_s"]
    return phases


def save_costs(results: dict) -> dict:
    """Checkpoint saves: the first of each launch (megatron-core's writer starts its helper
    processes then) and the later ones."""
    first, later = [], []
    for result in results.values():
        for attempt in result["attempts"]:
            spans = [s["end"] - s["start"] for _, s in sorted(attempt["saves"].items(),
                                                               key=lambda kv: int(kv[0]))]
            first += spans[:1]
            later += spans[1:]
    return {"first_in_launch_median_s": statistics.median(first) if first else None,
            "later_median_s": statistics.median(later) if later else None}


def loss_check(runs: dict, reference: dict, restart: dict) -> dict:
    ref = {r["iteration"]: r["loss"] for r in reference["records"]}

    def rel(records):
        return max(abs(r["loss"] - ref[r["iteration"]]) / abs(ref[r["iteration"]])
                   for r in records)

    computed = {}  # restart: every computation of an iteration, first runs and redos
    for attempt in restart["attempts"]:
        for c in attempt["iterations"]:
            if c["loss"] is not None:  # None: no line shows that iteration's loss alone
                computed.setdefault(c["iteration"], []).append(c["loss"])
    redone = {i: losses for i, losses in computed.items() if len(losses) > 1}
    def absolute(records):
        return max(abs(r["loss"] - ref[r["iteration"]]) for r in records)

    return {"max_rel_loss_diff_recover": rel(runs["recover"]["records"]),
            "max_abs_loss_diff_recover": absolute(runs["recover"]["records"]),
            "max_rel_loss_diff_adaptive": rel(runs["adaptive"]["records"]),
            "max_abs_loss_diff_adaptive": absolute(runs["adaptive"]["records"]),
            "final_loss": {"reference": reference["records"][-1]["loss"],
                           **{s: runs[s]["records"][-1]["loss"] for s in runs}},
            "restart_redone_iterations": len(redone),
            "restart_redos_differing_from_first_run": sum(len(set(v)) > 1
                                                          for v in redone.values())}


# ---------------------------------------------------------------------------------------------
# The fair protocol: failures at a seeded spacing that does not depend on N, restart swept
# around its Young/Daly interval, figures per machine against allocated capacity
# ---------------------------------------------------------------------------------------------

MTBF_ITERS = 16
FIRST_N = 4  # the restart interval run first; its saves give Young/Daly's checkpoint cost
RESTART_COSTS = ("save_s", "writer_startup_s", "lost_work_s", "detection_s",
                 "restart_initialization_s", "checkpoint_load_s", "redo_s", "training_s")
RECOVER_COSTS = ("detection_and_repair_s", "restore_s", "training_s")


def spaced_failures(mtbf_iters: float, count: int, seed: int) -> list[int]:
    """Iterations at which a rank dies: gaps drawn from an exponential of mean `mtbf_iters`
    (at least one iteration), from iteration 1 on; the same for every system and every N."""
    rng = random.Random(seed)
    out, at = [], 1
    for _ in range(count):
        at += max(1, round(rng.expovariate(1.0 / mtbf_iters)))
        out.append(at)
    return out


def spaced_train_iters(failures: list[int], mtbf_iters: float) -> int:
    return failures[-1] + round(mtbf_iters)


def window_figures(timeline: dict, iterations: int) -> dict:
    """From the end of iteration 1 (start-up is the same for all) to the first completion of
    the last iteration: committed tokens per second of the machine, and per allocated process
    (8 throughout for every system: a dead process counts, nothing replaces it; a restart
    relaunches all 8)."""
    firsts = {i: (t, tokens) for t, i, tokens in first_completions(timeline)}
    start, end = firsts[1][0], firsts[iterations][0]
    tokens = sum(tok for i, (_, tok) in firsts.items() if 2 <= i <= iterations)
    allocation = Allocation.constant(RANKS, start, end)
    return {"window": [start, end], "window_s": end - start, "committed_tokens": tokens,
            "tokens_per_s_per_machine": tokens / (end - start),
            "goodput_per_allocated_process": goodput(tokens, allocation)}


def save_spans(result: dict) -> list[list[float]]:
    """Each launch's save durations in order, without the save after the last iteration (it
    lies outside the window)."""
    last = result["train_iters"]
    return [[s["end"] - s["start"] for i, s in sorted(a["saves"].items(), key=lambda kv:
                                                      int(kv[0])) if int(i) < last]
            for a in result["attempts"]]


def typical_save_s(results: list[dict]) -> float:
    """The median save of the runs' launches after each launch's first (a first save also
    starts the writer's helpers); every save when no launch saved twice."""
    spans = [launch for result in results for launch in save_spans(result)]
    later = [x for launch in spans for x in launch[1:]]
    return statistics.median(later or [x for launch in spans for x in launch])


def restart_costs(result: dict, figures: dict, typical_save_s: float) -> dict:
    """The restart's window split into phases (seconds, summed over the run). A launch's
    first save is split into a typical save (`typical_save_s`) and the writer start-up."""
    spans = save_spans(result)
    typical = typical_save_s
    firsts = [launch[0] for launch in spans if launch]
    writer = sum(max(0.0, x - typical) for x in firsts) if typical is not None else 0.0
    phases = {"save_s": sum(map(sum, spans)) - writer, "writer_startup_s": writer}
    attempts = result["attempts"]
    lost = 0.0
    for i, (before, after) in enumerate(zip(attempts, attempts[1:])):
        resumed = after["load"]["iteration"]
        saved = [a["saves"][str(resumed)]["end"] for a in attempts[:i + 1]
                 if str(resumed) in a["saves"]]
        # Lost: this launch's training after the checkpoint it will resume from (a checkpoint
        # of an earlier launch: all of this launch's training).
        began = max(figures["window"][0], before["load"]["end"], *saved[-1:])
        lost += before["kill"]["time"] - began
    failures = breakdown(attempts)
    phases.update(lost_work_s=lost,
                  detection_s=sum(f["failure_handling_s"] for f in failures),
                  restart_initialization_s=sum(f["restart_initialization_s"] for f in failures),
                  checkpoint_load_s=sum(f["checkpoint_load_s"] for f in failures),
                  redo_s=sum(f["rerun_s"] or 0.0 for f in failures))
    phases["training_s"] = figures["window_s"] - sum(phases.values())
    return phases


def recover_costs(run: dict, figures: dict) -> dict:
    events = [e for r in run["records"] for e in r["events"] if e["event"] == "failure"]
    kills = [m["time"] for m in run["markers"]]
    phases = {"detection_and_repair_s": sum(e["detected"] - k for e, k in zip(events, kills)),
              "restore_s": sum(e["restored"] - e["detected"] for e in events)}
    phases["training_s"] = figures["window_s"] - sum(phases.values())
    return phases


def iteration_seconds(result: dict) -> float:
    """Median gap between successive iteration lines of a failure-free stock run."""
    times = [c["time"] for c in result["attempts"][0]["iterations"]]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def young_daly_n(save_s: float, iteration_s: float, mtbf_iters: float) -> tuple[int, float]:
    """Young/Daly's interval for this save cost and failure spacing, in iterations."""
    interval_s = young_daly_interval_s(save_s, mtbf_iters * iteration_s)
    return max(1, round(interval_s / iteration_s)), interval_s


def simulator_inputs(restarts: dict, figures: dict, recover_figures: dict, iteration_s: float,
                     failures: list[int], iterations: int) -> dict:
    """Event costs measured at every swept N but the largest, and the largest N's measured
    ratio: what the goodput simulator's cpu-benchmark anchor predicts."""
    held_out = max(restarts)
    fit = sorted(n for n in restarts if n != held_out)
    save_s = typical_save_s([restarts[n] for n in fit])
    firsts = [launch[0] for n in fit for launch in save_spans(restarts[n]) if launch]
    events = [f for n in fit for f in breakdown(restarts[n]["attempts"])]
    return {
        "fit_N": fit, "held_out_N": held_out, "iteration_s": iteration_s,
        "train_iters": iterations, "failures": failures, "save_s": save_s,
        "writer_startup_s": max(0.0, statistics.median(firsts) - save_s),
        "failure_cost_s": statistics.median(f["failure_handling_s"]
                                            + f["restart_initialization_s"]
                                            + f["checkpoint_load_s"] for f in events),
        "kill_offset_s": statistics.median(f["kill_after_iteration_began_s"] for f in events),
        "committed_tokens": figures[held_out]["committed_tokens"],
        "recover_tokens_per_s": recover_figures["tokens_per_s_per_machine"],
        "measured_ratio_held_out": recover_figures["tokens_per_s_per_machine"]
        / figures[held_out]["tokens_per_s_per_machine"]}


def fair_protocol(out: Path, job: list[str], mtbf_iters: float, seed: int, progress) -> dict:
    failures = spaced_failures(mtbf_iters, FAILURES, seed)
    iterations = spaced_train_iters(failures, mtbf_iters)
    base = out / "fair"
    progress(f"fair protocol: failures at iterations {failures} (mean spacing {mtbf_iters} "
             f"iterations, seed {seed}), {iterations} iterations, every N")
    progress("  failure-free stock run (the ETTR denominator)")
    stock = run_restart(base / "failure-free-stock", job, iterations + 1,
                        lambda s: progress(f"  {s}"), failures=[], iterations=iterations)
    stock_figures = window_figures(restart_timeline(stock), iterations)
    iteration_s = iteration_seconds(stock)
    runs, figures, costs = {}, {}, {}
    for system, extra in (("recover", []), ("adaptive", ["--recover-policy", "adaptive"])):
        progress(f"  {system}: --recover {' '.join(extra)}")
        runs[system] = run_recover(base / system, job, iterations, extra, failures)
        figures[system] = window_figures(recover_timeline(runs[system]), iterations)
        costs[system] = recover_costs(runs[system], figures[system])
    restarts, restart_figures = {}, {}

    def restart_at(n: int) -> None:
        progress(f"  restart: checkpoint every {n} iterations")
        restarts[n] = run_restart(base / f"restart-N{n}", job, n, lambda s: progress(f"  {s}"),
                                  failures=failures, iterations=iterations)
        restart_figures[n] = window_figures(restart_timeline(restarts[n]), iterations)
        progress(f"    {restart_figures[n]['tokens_per_s_per_machine']:.1f} tokens/s per "
                 f"machine (recover {figures['recover']['tokens_per_s_per_machine']:.1f})")

    restart_at(FIRST_N)
    save_s = typical_save_s([restarts[FIRST_N]])
    n_opt, interval_s = young_daly_n(save_s, iteration_s, mtbf_iters)
    sweep = sorted({FIRST_N, max(1, n_opt // 2), n_opt, 2 * n_opt})
    progress(f"  Young/Daly: save {save_s:.2f} s, iteration {iteration_s:.3f} s, MTBF "
             f"{mtbf_iters} iterations -> N = {n_opt}; sweeping {sweep}")
    for n in sweep:
        if n not in restarts:
            restart_at(n)

    def best_n():
        return max(restart_figures, key=lambda n: restart_figures[n]["tokens_per_s_per_machine"])

    # Young/Daly knows only the per-save cost; each launch's first save also pays the writer's
    # start-up. Until the best interval is bracketed (at most twice), try twice the largest.
    for _ in range(2):
        if best_n() != max(restarts):
            break
        progress(f"  the best interval is the largest tried: trying {2 * max(restarts)}")
        restart_at(2 * max(restarts))
    best = best_n()
    ideal = stock_figures["goodput_per_allocated_process"]

    def ettr_of(f):
        return f["goodput_per_allocated_process"] / ideal

    progress("  reference: failure-free --recover (the loss trajectory)")
    reference = run_recover(base / "reference", job, iterations, [], None)
    ref = {r["iteration"]: r["loss"] for r in reference["records"]}

    def max_rel(run):
        return max(abs(r["loss"] - ref[r["iteration"]]) / abs(ref[r["iteration"]])
                   for r in run["records"])

    return {
        "failure_spacing": {"mtbf_iterations": mtbf_iters, "seed": seed,
                            "failure_iterations": failures, "train_iters": iterations,
                            "mtbf_s_failure_free": mtbf_iters * iteration_s},
        "young_daly": {"save_s": save_s, "iteration_s": iteration_s,
                       "interval_s": interval_s, "N": n_opt, "swept_N": sorted(restarts)},
        "ratio_per_machine_vs_best_restart":
            figures["recover"]["tokens_per_s_per_machine"]
            / restart_figures[best]["tokens_per_s_per_machine"],
        "ratio_per_machine_adaptive_vs_best_restart":
            figures["adaptive"]["tokens_per_s_per_machine"]
            / restart_figures[best]["tokens_per_s_per_machine"],
        "best_restart_N": best,
        "per_machine_tokens_per_s": {
            "failure_free_stock": stock_figures["tokens_per_s_per_machine"],
            **{s: figures[s]["tokens_per_s_per_machine"] for s in figures},
            **{f"restart_N{n}": restart_figures[n]["tokens_per_s_per_machine"]
               for n in sorted(restart_figures)}},
        "ettr": {**{s: ettr_of(figures[s]) for s in figures},
                 **{f"restart_N{n}": ettr_of(restart_figures[n])
                    for n in sorted(restart_figures)}},
        "phases_s": {**{s: costs[s] for s in costs},
                     **{f"restart_N{n}": restart_costs(restarts[n], restart_figures[n], save_s)
                        for n in sorted(restarts)}},
        "window_s": {**{s: figures[s]["window_s"] for s in figures},
                     **{f"restart_N{n}": restart_figures[n]["window_s"]
                        for n in sorted(restart_figures)}},
        "restart_launches": {str(n): restarts[n]["launches"] for n in sorted(restarts)},
        "simulator_inputs": simulator_inputs(restarts, restart_figures, figures["recover"],
                                             iteration_s, failures, iterations),
        "max_rel_loss_diff": {s: max_rel(runs[s]) for s in runs},
    }


# ---------------------------------------------------------------------------------------------
# Figures (drawn from the records above only)
# ---------------------------------------------------------------------------------------------

COLORS = {"recover": "C0", "adaptive": "C3", "restart": "C2", "reference": "k"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(out: Path, per_n: dict) -> Path:
    plt = _plt()
    ns = sorted(per_n)
    fig, axes = plt.subplots(2, len(ns), figsize=(3.2 * len(ns), 5.5), squeeze=False)
    for col, n in enumerate(ns):
        for row, key in enumerate(("effective_throughput", "tokens_per_s")):
            ax = axes[row][col]
            for system in SYSTEMS:
                values = [iv[key] for iv in per_n[n]["intervals"][system]]
                ax.plot(range(len(values)), values, "o-", color=COLORS[system], label=system)
            ax.set_xticks(range(FAILURES + 1))
            ax.set_xlabel("failures so far")
            if row == 0:
                ax.set_title(f"N = {n}")
        axes[0][0].set_ylabel("tokens / s / live process")
        axes[1][0].set_ylabel("tokens / s (whole machine)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("(a) Effective throughput per failure interval (8 processes, 2 CPU cores)")
    fig.tight_layout()
    path = out / "fig8a_throughput_per_interval.png"
    fig.savefig(path, dpi=100)
    return path


def plot_curves(out: Path, per_n: dict) -> Path:
    plt = _plt()
    ns = sorted(per_n)
    fig, axes = plt.subplots(1, len(ns), figsize=(3.2 * len(ns), 3.2), squeeze=False)
    for col, n in enumerate(ns):
        ax = axes[0][col]
        for system in SYSTEMS:
            xs, ys = zip(*per_n[n]["curves"][system])
            ax.plot(xs, [y / 1e3 for y in ys], color=COLORS[system], label=system)
        ax.set_title(f"N = {n}")
        ax.set_xlabel("process-hours")
    axes[0][0].set_ylabel("committed tokens (thousands)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("(b) Cumulative committed tokens vs process-hours")
    fig.tight_layout()
    path = out / "fig8b_tokens_vs_process_hours.png"
    fig.savefig(path, dpi=100)
    return path


def plot_breakdown(out: Path, per_n: dict) -> Path:
    plt = _plt()
    ns = sorted(per_n)
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.38
    for i, n in enumerate(ns):
        bottom = 0.0
        for j, phase in enumerate(RESTART_PHASES):
            value = per_n[n]["breakdown"]["restart"][phase] or 0.0
            ax.bar(i - width / 2, value, width, bottom=bottom, color=f"C{j}",
                   label=f"restart: {phase[:-2].replace('_', ' ')}" if i == 0 else None)
            bottom += value
        bottom = 0.0
        for j, phase in enumerate(RECOVER_PHASES):
            value = per_n[n]["breakdown"]["recover"][phase]
            ax.bar(i + width / 2, value, width, bottom=bottom, color=f"C{j}", hatch="//",
                   label=f"recover: {phase[:-2].replace('_', ' ')}" if i == 0 else None)
            bottom += value
    ax.set_xticks(range(len(ns)))
    ax.set_xticklabels([f"N = {n}\nrestart | recover" for n in ns])
    ax.set_ylabel("seconds, end of iteration N to end of iteration 1.5N")
    ax.set_title("(c) Single-failure wall-clock breakdown vs checkpoint interval N")
    ax.text(0.01, 0.98, "On this machine restart cost is mostly process start and imports\n"
            "(8 Python processes loading torch and megatron-core on 2 cores). The save at N is\n"
            "a launch's first: megatron-core's writer starts helper processes then.",
            transform=ax.transAxes, va="top", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = out / "fig8c_breakdown_vs_N.png"
    fig.savefig(path, dpi=100)
    return path


def plot_fair(out: Path, fair: dict) -> Path:
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    names = [k for k in fair["per_machine_tokens_per_s"]]
    values = [fair["per_machine_tokens_per_s"][k] for k in names]
    colors = [COLORS.get(k.split("_")[0], "C7") for k in names]
    left.bar(range(len(names)), values, color=colors)
    left.set_xticks(range(len(names)))
    left.set_xticklabels([k.replace("_", " ") for k in names], rotation=30, ha="right",
                         fontsize=8)
    left.set_ylabel("committed tokens / s (whole machine)")
    spacing = fair["failure_spacing"]
    left.set_title(f"4 failures at iterations {spacing['failure_iterations']}\n"
                   f"(mean spacing {spacing['mtbf_iterations']}, seed {spacing['seed']}); "
                   f"Young/Daly N = {fair['young_daly']['N']}", fontsize=9)
    systems = [k for k in fair["phases_s"]]
    phases = list(dict.fromkeys(p for k in systems for p in fair["phases_s"][k]))
    bottoms = [0.0] * len(systems)
    for j, phase in enumerate(phases):
        heights = [fair["phases_s"][k].get(phase, 0.0) for k in systems]
        right.bar(range(len(systems)), heights, bottom=bottoms, color=f"C{j}",
                  label=phase[:-2].replace("_", " "))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    right.set_xticks(range(len(systems)))
    right.set_xticklabels([k.replace("_", " ") for k in systems], rotation=30, ha="right",
                          fontsize=8)
    right.set_ylabel("seconds of the window (end of iteration 1 to the last)")
    right.set_title("Where the time went", fontsize=9)
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = out / "fig_fair_per_machine.png"
    fig.savefig(path, dpi=100)
    return path


def plot_trajectory(out: Path, n: int, runs: dict, reference: dict, restart: dict) -> Path:
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    series = {"reference": reference, **runs}
    for name, run in series.items():
        records = run["records"]
        top.plot([r["iteration"] for r in records], [r["loss"] for r in records],
                 color=COLORS[name], linestyle="-" if name == "reference" else "--", label=name)
        # The iteration's own time: from its start to its commit and optimizer step.
        bottom.plot([r["iteration"] for r in records],
                    [r["tokens"] / (r["iteration_ms"] / 1e3 * (r["live_replicas"] or RANKS))
                     for r in records], color=COLORS[name], label=name)
    kept = last_completions(restart_timeline(restart))
    losses = {c["iteration"]: c["loss"] for a in restart["attempts"] for c in a["iterations"]
              if c["loss"] is not None}
    shown = [i for _, i, _ in kept if i in losses]
    top.plot(shown, [losses[i] for i in shown], color=COLORS["restart"],
             linestyle=":", label="restart (stock dropout stream)")
    for f in failure_iterations(n):
        for ax in (top, bottom):
            ax.axvline(f, color="grey", linewidth=0.5)
    top.set_ylabel("lm loss")
    top.legend(fontsize=8)
    top.set_title(f"Figure 7 analogue: loss vs failure-free reference, 4 failures (N = {n})")
    bottom.set_ylabel("tokens / s / live process")
    bottom.set_xlabel("iteration")
    fig.tight_layout()
    path = out / "fig7_loss_and_throughput.png"
    fig.savefig(path, dpi=100)
    return path


# ---------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench")
    parser.add_argument("--mtbf-iters", type=float, default=MTBF_ITERS,
                        help="mean spacing of the fair protocol's failures, in iterations")
    parser.add_argument("--seed", type=int, default=2026, help="the failure spacing's seed")
    parser.add_argument("--paper-intervals", default="2,4,8,16",
                        help="checkpoint intervals N of the paper's protocol (comma-separated)")
    parser.add_argument("--reuse", action="store_true",
                        help="read the runs recorded under --out instead of running them again "
                             "(to recompute the summary and figures); run only missing ones")
    args = parser.parse_args()
    REUSE["on"] = args.reuse
    ns = sorted(int(x) for x in args.paper_intervals.split(","))
    if ns[0] < 2:
        parser.error("--paper-intervals: N >= 2 (failure 1 lands at 1.5N, after the first "
                     "checkpoint)")
    if args.mtbf_iters < 1:
        parser.error("--mtbf-iters must be >= 1")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stream = sys.stderr if args.json else sys.stdout
    began = time.time()

    def progress(message: str) -> None:
        print(f"[{time.time() - began:6.0f}s] {message}", file=stream, flush=True)

    data_dir = out / "data"
    if not (data_dir / "corpus_text_document.idx").exists():
        progress(f"building the demo corpus and tokenizer in {data_dir}")
        built = subprocess.run([sys.executable, str(ROOT / "scripts/make_demo_corpus.py"),
                                "--output-dir", str(data_dir)], capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"building the corpus failed:\n{built.stdout}{built.stderr}")
    job = job_arguments(data_dir)
    fair = fair_protocol(out, job, args.mtbf_iters, args.seed, progress)
    progress(f"fair protocol: recover / best restart (N = {fair['best_restart_N']}) per "
             f"machine {fair['ratio_per_machine_vs_best_restart']:.2f}")

    progress("paper protocol: failures at 1.5N, 2.5N, ...")
    per_n, restarts, kept = {}, {}, {}
    for n in ns:
        failures, iterations = failure_iterations(n), train_iters(n)
        progress(f"N = {n}: failures at iterations {failures}, {iterations} iterations")
        runs = {}
        for system, extra in (("recover", []), ("adaptive", ["--recover-policy", "adaptive"])):
            progress(f"  {system}: --recover {' '.join(extra)}")
            runs[system] = run_recover(out / f"N{n}" / system, job, iterations, extra,
                                       failures)
        progress(f"  restart: checkpoint every {n} iterations")
        restarts[n] = run_restart(out / f"N{n}" / "restart", job, n,
                                  lambda s: progress(f"  {s}"))
        timelines = {s: recover_timeline(runs[s]) for s in runs}
        timelines["restart"] = restart_timeline(restarts[n])
        per_n[n] = {
            "failures": failures, "train_iters": iterations,
            "intervals": {s: intervals(timelines[s], n, iterations) for s in SYSTEMS},
            "curves": {s: curve(timelines[s]) for s in SYSTEMS},
            "breakdown": {"restart": restart_breakdown(restarts[n]),
                          **{s: recover_breakdown(runs[s], timelines[s], n, failures[0])
                             for s in runs}},
            "wall_s": {s: timelines[s]["end"] - timelines[s]["start"] for s in SYSTEMS},
            "restart_launches": restarts[n]["launches"]}
        kept[n] = runs
        after = {s: per_n[n]["intervals"][s][-1]["effective_throughput"] for s in SYSTEMS}
        progress("  after 4 failures, tokens/s/process: "
                 + ", ".join(f"{s} {v:.1f}" for s, v in after.items()))

    n_ref = ns[-1]
    progress(f"reference: failure-free --recover, {train_iters(n_ref)} iterations")
    reference = run_recover(out / f"N{n_ref}" / "reference", job, train_iters(n_ref), [], None)
    png = [plot_fair(out, fair), plot_throughput(out, per_n), plot_curves(out, per_n),
           plot_breakdown(out, per_n),
           plot_trajectory(out, n_ref, kept[n_ref], reference, restarts[n_ref])]
    paper = summarize(per_n, restarts, kept[n_ref], reference, restarts[n_ref], n_ref)
    summary = {"setup": paper.pop("setup"), **fair, "bias": BIAS, "paper_protocol": paper}
    summary["bench_wall_s"] = time.time() - began
    summary["figures"] = [str(p.relative_to(out)) for p in png]
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    progress(f"wrote {out / 'summary.json'} and {len(png)} figures")
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
    return 0


def summarize(per_n: dict, restarts: dict, runs: dict, reference: dict, restart: dict,
              n_ref: int) -> dict:
    after = {n: {s: v["intervals"][s][-1] for s in SYSTEMS} for n, v in per_n.items()}
    best = max(after, key=lambda n: after[n]["restart"]["effective_throughput"])
    best_machine = max(after, key=lambda n: after[n]["restart"]["tokens_per_s"])

    def ratio(system, n, key):
        return after[n][system][key] / after[n]["restart"][key]

    return {
        "setup": {"replicas": RANKS, "ranks_per_replica": 1, "cpu_cores": os.cpu_count(),
                  "model": f"GPT {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, sequence "
                           f"{SEQ_LENGTH}; the demo corpus, 512-token BPE",
                  "global_batch_microbatches": GLOBAL_BATCH,
                  "tokens_per_iteration": TOKENS_PER_ITERATION, "failures": FAILURES},
        "ratio_per_live_process_vs_best_restart": ratio("recover", best,
                                                        "effective_throughput"),
        "ratio_per_live_process_vs_best_restart_adaptive": ratio("adaptive", best,
                                                                 "effective_throughput"),
        "best_restart_N": best,
        "ratio_per_machine_vs_best_restart": ratio("recover", best_machine, "tokens_per_s"),
        "best_restart_N_per_machine": best_machine,
        "per_N": {str(n): {
            "failures": v["failures"], "train_iters": v["train_iters"],
            "effective_throughput": {s: [round(iv["effective_throughput"], 2)
                                         for iv in v["intervals"][s]] for s in SYSTEMS},
            "tokens_per_s": {s: [round(iv["tokens_per_s"], 1) for iv in v["intervals"][s]]
                             for s in SYSTEMS},
            "ratio_after_4_failures": {
                "recover_vs_restart": ratio("recover", n, "effective_throughput"),
                "adaptive_vs_restart": ratio("adaptive", n, "effective_throughput"),
                "recover_vs_restart_per_machine": ratio("recover", n, "tokens_per_s")},
            "single_failure_breakdown_s": {s: {k: round(x, 3) for k, x in b.items()}
                                           for s, b in v["breakdown"].items()},
            "wall_s": {s: round(x, 1) for s, x in v["wall_s"].items()},
            "restart_launches": v["restart_launches"]} for n, v in per_n.items()},
        "checkpoint_save": save_costs(restarts),
        "restart_output_delay_s": {str(n): r["output_delay_s"] for n, r in restarts.items()},
        "trajectory_N": n_ref,
        "trajectory": loss_check(runs, reference, restart),
        "notes": [
            "Restart cost on this machine is mostly process start and imports: 8 Python "
            "processes importing torch and megatron-core and building the model on 2 cores "
            "(restart_initialization_s); the first checkpoint save of every launch also starts "
            "megatron-core's writer helper processes (checkpoint_save.first_in_launch).",
            "Effective throughput per live process favours the systems that lose processes on "
            "this machine: 8 processes share 2 cores, so survivors get more CPU each (a "
            "dedicated accelerator would not speed up). tokens_per_s (whole machine) and "
            "ratio_per_machine_vs_best_restart leave that out.",
            "Recover failures land inside the second bucket's all-reduce; restart kills land "
            "as the iteration begins (kill_after_iteration_began_s), so the baseline loses at "
            "most one iteration less than with a kill during gradient synchronization.",
            "The restart job runs stock Megatron, whose dropout stream differs from exact "
            "mode's per-microbatch seeds; its redone iterations are checked against their "
            "first computation instead (restart_redos_differing_from_first_run)."],
    }


BIAS = [
    "Allocation: restart relaunches all 8 processes (a spare replaces the dead one); recover "
    "goes on with the survivors. Both count 8 processes for the whole window (a dead process "
    "stays allocated until replaced), so per allocated process and per machine give the same "
    "ratio. On this machine recover's survivors also inherit the dead processes' share of the "
    "2 cores, which a GPU cluster never gives back: after each failure recover runs faster "
    "here than it would there. Restart cannot be relaunched like for like on 7 processes: "
    "Megatron refuses B = 32 microbatches over 7 data-parallel ranks.",
    "Restart's cost here is mostly Python start-up (8 processes importing torch and "
    "megatron-core on 2 cores: restart_initialization_s) and megatron-core's writer helper "
    "started at each launch's first save (writer_startup_s): real on this machine, not what a "
    "GPU cluster pays. The goodput simulator takes cluster-scale costs.",
    "Saves are synchronous: --async-save is refused at start-up (our loop does not drive "
    "megatron-core's asynchronous save queue, and on a CPU run that save's host copy, "
    "tensor.to('cpu'), returns the live tensor itself). save_s is reported on its own, so "
    "an asynchronous save's gain is bounded by it.",
    "Kills: recover's victims die inside a gradient all-reduce; restart's are killed by the "
    "driver as the iteration begins, before its gradient synchronization, so the baseline "
    "loses up to one iteration less per failure.",
    "Data planes: recover reduces gradients on its default plane, torch (gloo over loopback "
    "TCP on this machine); restart's stock data parallelism runs over the ulfm backend "
    "(--cross-replica-backend ulfm: MPI over shared memory on one host, faster here, "
    "docs/data-planes.md), whose torch.distributed calls fail stop, so a death ends the stock "
    "job as over gloo. The difference favours restart.",
]


def print_table(summary: dict) -> None:
    spacing, yd = summary["failure_spacing"], summary["young_daly"]
    print(f"Fair protocol: 4 failures at iterations {spacing['failure_iterations']} (mean "
          f"spacing {spacing['mtbf_iterations']} iterations, seed {spacing['seed']}), "
          f"{spacing['train_iters']} iterations; Young/Daly N = {yd['N']} (save "
          f"{yd['save_s']:.2f} s, iteration {yd['iteration_s']:.3f} s)")
    print(f"  {'system':>22} {'tokens/s/machine':>17} {'ETTR':>6}")
    for name, value in summary["per_machine_tokens_per_s"].items():
        ettr = summary["ettr"].get(name)
        print(f"  {name:>22} {value:>17.1f} {'' if ettr is None else f'{ettr:6.3f}':>6}")
    print(f"  ratio_per_machine_vs_best_restart: "
          f"{summary['ratio_per_machine_vs_best_restart']:.2f} (best restart N = "
          f"{summary['best_restart_N']})")
    for name, phases in summary["phases_s"].items():
        print(f"  {name}: " + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in phases.items()))
    paper = summary["paper_protocol"]
    print("\nPaper protocol (failures at 1.5N, 2.5N, ...; per live process as the paper "
          "counts):")
    for n, v in paper["per_N"].items():
        ratios = v["ratio_after_4_failures"]
        print(f"  N = {n:>3}: recover / restart {ratios['recover_vs_restart']:.2f} per live "
              f"process, {ratios['recover_vs_restart_per_machine']:.2f} per machine")
    print(f"  best restart N = {paper['best_restart_N']}: "
          f"{paper['ratio_per_live_process_vs_best_restart']:.2f} per live process (the "
          f"paper: 2.23 on 512 GPUs)")
    for note in summary["bias"] + paper["notes"]:
        print(f"note: {note}")


if __name__ == "__main__":
    sys.exit(main())
