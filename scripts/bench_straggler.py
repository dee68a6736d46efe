"""A straggler's cost with and without balancing, side by side in one sitting.

Usage: .venv/bin/python scripts/bench_straggler.py [--json] [--ranks 2] [--factor 2]
       [--iterations 16] [--rounds 2] [--microbatches 12]

Runs the same GPT job (mock data, CPU, `--ranks` replicas of one rank each, `--microbatches`
microbatches per replica, so B = ranks x microbatches) under --recover in three modes,
alternately, `--rounds` times each (this machine is noisy):
  failure-free   nothing slowed
  slowed         replica 1 takes `--factor` times as long per pass from iteration 3 (the failure
                 schedule's `slow` action), the layout unchanged: every iteration waits for it
  balanced       the same slowdown with --recover-straggler-threshold 0.25 and
                 --recover-straggler-window 3: replica 1 gets fewer microbatches, the others more
Reports the median iteration time of each over the iterations after the layout settled
(slowdown start + window + 2 on), the ratios to failure-free, and two bounds for the balanced
run: the capacity bound W / (sum of the replicas' relative speeds), what a perfectly divisible
batch would reach, and the integer bound, the best split of B into whole microbatches
(`balanced_quotas`) over the failure-free per-replica work. The slowed rank sleeps after each
pass (off its core); with one rank per core and one thread per rank (the launcher's
OMP_NUM_THREADS=1) its idle core speeds nobody up, so the figures are the layout's effect.
"""

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_recover.launch import LaunchConfig, launch  # noqa: E402
from megatron_recover.policy.speed import balanced_quotas  # noqa: E402

SLOW_REPLICA, SLOW_FROM, WINDOW = 1, 3, 3
ITERATION_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): "
                          r"([0-9.]+)")


def job(iterations: int, ranks: int, microbatches: int) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
            "--eval-iters", "0", "--seq-length", "128", "--max-position-embeddings", "128",
            "--micro-batch-size", "1", "--global-batch-size", str(microbatches * ranks),
            "--train-iters", str(iterations), "--lr", "1e-3", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--log-interval", "1",
            "--overlap-grad-reduce", "--recover", "--recover-hang-timeout", "0"]


def run_mode(name: str, extra: list[str], schedule: str | None, args, tmp: Path) -> dict:
    """One run: its iteration times from the settled iteration on, and its recovery log."""
    where = tmp / name
    where.mkdir(parents=True)
    log = where / "log.jsonl"
    flags = ["--recover-log", str(log), *extra]
    if schedule is not None:
        (where / "schedule.yaml").write_text(schedule)
        flags += ["--recover-failure-schedule", str(where / "schedule.yaml")]
    command = [sys.executable, str(ROOT / "pretrain_gpt_recover.py"),
               *job(args.iterations, args.ranks, args.microbatches), *flags]
    result = launch(LaunchConfig(args.ranks, command, where / "status", timeout_s=900))
    if not result.succeeded:
        raise SystemExit(f"{name} run failed:\n{result.output[-3000:]}")
    settled = SLOW_FROM + WINDOW + 2
    times = {int(it): float(ms) for it, ms in ITERATION_MS.findall(result.output)}
    records = [json.loads(line) for line in log.read_text().splitlines()]
    settled_records = [r for r in records if r["iteration"] >= settled]
    return {"times": [times[i] for i in sorted(times) if i >= settled],
            "quotas": records[-1]["quotas"],
            "speeds": [r["speeds"] for r in settled_records if r["speeds"]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=12)
    args = parser.parse_args()
    if args.ranks < 2 or args.factor <= 1:
        parser.error("--ranks >= 2 (one replica is slowed) and --factor > 1")
    if args.iterations < SLOW_FROM + WINDOW + 4:
        parser.error(f"--iterations must be at least {SLOW_FROM + WINDOW + 4}: the layout "
                     "settles after the slowdown's start and the window")
    slow = ("entries:\n  - {iteration: %d, replica: %d, local_rank: 0, location: pre-forward, "
            "action: slow, factor: %g}\n" % (SLOW_FROM, SLOW_REPLICA, args.factor))
    balance = ["--recover-straggler-threshold", "0.25", "--recover-straggler-window",
               str(WINDOW)]
    modes = {"failure-free": ([], None), "slowed": ([], slow), "balanced": (balance, slow)}
    runs = {name: {"times": [], "quotas": None, "speeds": []} for name in modes}
    with tempfile.TemporaryDirectory(prefix="bench-straggler-") as tmp:
        for round_index in range(args.rounds):
            for name, (extra, schedule) in modes.items():
                print(f"round {round_index + 1}/{args.rounds}: {name}", file=sys.stderr,
                      flush=True)
                run = run_mode(f"{name}-{round_index}", extra, schedule, args, Path(tmp))
                runs[name]["times"] += run["times"]
                runs[name]["quotas"] = run["quotas"]
                runs[name]["speeds"] += run["speeds"]
    ms = {name: statistics.median(run["times"]) for name, run in runs.items()}
    speeds = [1.0] * args.ranks
    speeds[SLOW_REPLICA] = 1 / args.factor
    capacity = args.ranks / sum(speeds)
    b = args.ranks * args.microbatches
    quotas = balanced_quotas(b, {r: 1 / s for r, s in enumerate(speeds)})
    integer = max(quotas[r] / speeds[r] for r in quotas) / args.microbatches
    balanced = ms["balanced"] / ms["failure-free"]
    # The slowed replica's time per microbatch over the others' mean, as the replicas measured
    # it in the balanced runs (what the policy saw), and the capacity bound at that speed.
    slow_key = str(SLOW_REPLICA)
    measured = statistics.median(
        s[slow_key] / statistics.fmean(t for r, t in s.items() if r != slow_key)
        for s in runs["balanced"]["speeds"])
    measured_capacity = args.ranks / (args.ranks - 1 + 1 / measured)
    report = {
        "ranks": args.ranks, "factor": args.factor, "B": b,
        "iterations_measured": {name: len(run["times"]) for name, run in runs.items()},
        "median_ms": ms,
        "ratio_slowed": ms["slowed"] / ms["failure-free"],
        "ratio_balanced": balanced,
        "capacity_bound": capacity,
        "integer_bound": integer,
        "balanced_over_capacity_bound": balanced / capacity,
        "balanced_over_integer_bound": balanced / integer,
        "measured_slowdown": measured,
        "capacity_bound_measured": measured_capacity,
        "quotas_balanced": runs["balanced"]["quotas"],
        "quotas_best": {str(r): q for r, q in quotas.items()},
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"median iteration time, {args.ranks} replicas, replica {SLOW_REPLICA} slowed "
          f"{args.factor:g}x (ms): " + ", ".join(f"{n} {t:.1f}" for n, t in ms.items()))
    print(f"over failure-free: slowed {report['ratio_slowed']:.3f}, balanced {balanced:.3f}; "
          f"capacity bound {capacity:.3f}, integer bound {integer:.3f} (quotas "
          f"{report['quotas_balanced']}, best {report['quotas_best']}); measured slowdown "
          f"{measured:.2f}x, capacity bound at it {measured_capacity:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
