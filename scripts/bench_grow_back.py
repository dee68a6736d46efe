"""Grow back: the same job and failure schedule without standbys and with enough of them.

Usage: .venv/bin/python scripts/bench_grow_back.py [--json] [--replicas 8] [--failures 6]
       [--iterations 24] [--out runs/grow-back] [--timeout 600]

Three runs of one tiny GPT (replicas of one rank, exact mode, B = 2 x replicas): a failure-free
reference; the failure run with --recover-standby-replicas 0, which shrinks for good; the same
schedule with as many standbys as failures, each called after the iteration that lost a
replica. From their per-iteration logs: live replicas and per-replica microbatches (G_cur) over
the iterations, each join's cost (call-up to state received, and to the first committed
iteration with the joiner), the largest loss difference to the reference, and throughput:
committed tokens per second of the whole machine, and per allocated process-second where the
allocation is every process the job holds (dead ones until replaced, standbys while they wait).

What the figures can show on two shared cores: whether the layout returns to W_init (G_cur back
to G_init) with B and the trajectory kept, and what a join costs. What they cannot: the
throughput gain of growing back. A replica here is a process sharing the same two cores, so
machine throughput barely depends on the live replica count, and the standbys' allocation is
charged while they add no core. On a cluster each replica is its own GPUs: there G_cur and the
live count are the figures that matter, and `megatron-recover goodput` takes the join cost
measured here to scale. Progress goes to stdout, or to stderr with --json, which prints the
summary (also written to OUT/summary.json). Exit status 0 when every run succeeded with the
ledger invariant held.
"""

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_recover.faults import read_markers  # noqa: E402
from megatron_recover.goodput.ettr import Allocation, goodput  # noqa: E402
from megatron_recover.launch import LaunchConfig, launch  # noqa: E402
from megatron_recover.testing.compare import loss_rdiff  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_scale import job_arguments  # noqa: E402  (the same tiny GPT)

G_INIT = 2
SEQ_LENGTH = 16  # bench_scale.job_arguments' sequence length
# Points every iteration reaches (an extension pass or a restore only follows a failure).
LOCATIONS = ("during-reduce", "backward", "pre-forward", "after-post", "during-consensus",
             "before-reduce")


def schedule(replicas: int, failures: int, iterations: int) -> str:
    """One death every few iterations, replicas 1, 2, ... in turn, cycling through locations;
    the last one leaves room for its join to commit before the end."""
    if not 0 < failures < replicas:
        raise SystemExit(f"--failures must be in 1..{replicas - 1}")
    spacing = max(2, (iterations - 4) // failures)
    lines = ["entries:"]
    for i in range(failures):
        lines.append(f"  - {{iteration: {2 + i * spacing}, replica: {1 + i}, local_rank: 0, "
                     f"location: {LOCATIONS[i % len(LOCATIONS)]}}}")
    if 2 + (failures - 1) * spacing >= iterations:
        raise SystemExit("--iterations too small for the failures: give more")
    return "\n".join(lines) + "\n"


def run(name: str, out: Path, ranks: int, args: list[str], timeout_s: float, say) -> dict:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir / "log.jsonl"
    say(f"=== {name}: {ranks} ranks")
    result = launch(LaunchConfig(ranks, [sys.executable, str(ROOT / "pretrain_gpt_recover.py"),
                                         *args, "--recover-log", str(log)],
                                 run_dir / "status", timeout_s))
    (run_dir / "output.txt").write_text(result.output)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    say(f"=== {name}: {'succeeded' if result.succeeded else 'FAILED'} in "
        f"{result.elapsed_s:.1f} s, {len(records)} iterations")
    return {"records": records, "succeeded": result.succeeded and not result.timed_out,
            "ranks": ranks, "statuses": result.statuses,
            "markers": read_markers(log.with_suffix(".markers.jsonl"))}


def throughput(job: dict) -> dict:
    """From the end of iteration 1 to the last commit: committed tokens per second of the
    machine and per allocated process-second (every rank the job holds, throughout)."""
    records = job["records"]
    start, end = records[0]["time"], records[-1]["time"]
    tokens = sum(r["contributions"] * SEQ_LENGTH for r in records[1:])
    return {"tokens_per_s": tokens / (end - start),
            "tokens_per_process_s": goodput(tokens, Allocation.constant(job["ranks"], start, end)),
            "allocated_processes": job["ranks"], "window_s": end - start}


def joins(records: list[dict]) -> list[dict]:
    found = []
    for record in records:
        for event in record["events"]:
            if event["event"] == "join":
                found.append({"after_iteration": event["after_iteration"],
                              "replicas": event["replicas"], "ranks": event["ranks"],
                              "state_s": event["state_received"] - event["called"],
                              "join_s": event["committed"] - event["called"]})
    return found


def _stats(values: list[float]) -> dict | None:
    return {"median": statistics.median(values), "max": max(values)} if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--failures", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--out", type=Path, default=ROOT / "runs/grow-back")
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stream = sys.stderr if args.json else sys.stdout

    def say(text):
        print(text, file=stream, flush=True)

    job = job_arguments(args.replicas, G_INIT, args.iterations)
    (out / "schedule.yaml").write_text(schedule(args.replicas, args.failures, args.iterations))
    failing = [*job, "--recover-failure-schedule", str(out / "schedule.yaml")]
    runs = {"reference": run("reference", out, args.replicas, job, args.timeout, say),
            "standbys_0": run("standbys_0", out, args.replicas, failing, args.timeout, say),
            f"standbys_{args.failures}": run(
                f"standbys_{args.failures}", out, args.replicas + args.failures,
                [*failing, "--recover-standby-replicas", str(args.failures)], args.timeout, say)}
    ok = all(r["succeeded"] and len(r["records"]) == args.iterations for r in runs.values())
    summary = {"setup": {"replicas": args.replicas, "failures": args.failures,
                         "iterations": args.iterations, "g_init": G_INIT,
                         "B": G_INIT * args.replicas, "cpu_cores": 2}, "ok": ok}
    if ok:
        reference = runs["reference"]["records"]
        grown = runs[f"standbys_{args.failures}"]
        summary.update({
            "live_replicas": {name: [r["live_replicas"] for r in job["records"]]
                              for name, job in runs.items()},
            "g_cur": {name: [r["g_cur"] for r in job["records"]] for name, job in runs.items()},
            "failures_injected": {name: len(job["markers"]) for name, job in runs.items()},
            "live_replicas_final": {name: job["records"][-1]["live_replicas"]
                                    for name, job in runs.items()},
            "invariant_ok": {name: all(r["invariant_ok"] and r["contributions"] == r["B"]
                                       for r in job["records"]) for name, job in runs.items()},
            "max_rel_loss_diff": {name: loss_rdiff(job["records"], reference)
                                  for name, job in runs.items() if name != "reference"},
            "joins": joins(grown["records"]),
            "throughput": {name: throughput(job) for name, job in runs.items()},
            "basis": "committed tokens from the end of iteration 1 to the last commit, per "
                     "second of the whole machine and per allocated process-second (every "
                     "process the job holds: dead ones until replaced, standbys while idle)",
        })
        summary["join_s"] = _stats([j["join_s"] for j in summary["joins"]])
        summary["state_s"] = _stats([j["state_s"] for j in summary["joins"]])
        summary["ok"] = ok = (all(summary["invariant_ok"].values()) and all(
            n == (0 if name == "reference" else args.failures)
            for name, n in summary["failures_injected"].items()))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.json:
        print(json.dumps(summary))
    else:
        say(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
