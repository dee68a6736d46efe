"""The cost of an extension pass of 1 microbatch, interleaved schedule against the plain one.

Usage: .venv/bin/python scripts/bench_interleaved.py [--repeats 3] [--out runs/interleaved]
       [--json] [--timeout 300]

One tiny GPT (4 layers, PP=2) on 4 replicas of 2 ranks, B = 8, exact mode, the same failure in
every run: iteration 2, replica 3 dies inside a bucket reduction, and two of the three survivors
each run an extension pass of 1 microbatch. The two arms differ only in the schedule: the plain
1F1B one, or the interleaved one with 2 virtual stages per rank, where megatron-core refuses a
pass of fewer microbatches than pipeline stages and the pass runs with one padding microbatch
(megatron_recover/megatron/adapters/interleaving.py). The arms alternate, `--repeats` runs each, side by
side in one invocation (this machine is noisy).

From each run's recovery log: the extension pass (the failure event's `restored - repaired`:
the rewind, the pass and the posting of its reductions), and the median failure-free iteration
time (iterations 3 and later) for scale. Printed: per arm the median over the repeats, and the
ratio interleaved / plain. Exit status 0 when every run succeeded with the ledger invariant
held in every iteration.
"""

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_recover.launch import LaunchConfig, launch  # noqa: E402

RANKS = 8
JOB = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
       "--eval-iters", "0", "--seq-length", "64", "--max-position-embeddings", "64",
       "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "6",
       "--lr", "3e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--log-interval", "1", "--pipeline-model-parallel-size", "2"]
ARMS = {"plain": [], "interleaved": ["--num-virtual-stages-per-pipeline-rank", "2"]}
SCHEDULE = "entries:\n  - {iteration: 2, replica: 3, local_rank: 0, location: during-reduce}\n"


def one_run(arm: str, where: Path, timeout_s: float) -> dict:
    if where.exists():
        shutil.rmtree(where)
    where.mkdir(parents=True)
    (where / "schedule.yaml").write_text(SCHEDULE)
    log = where / "log.jsonl"
    result = launch(LaunchConfig(RANKS, [sys.executable, str(ROOT / "pretrain_gpt_recover.py"),
                                         *JOB, *ARMS[arm], "--recover", "--recover-log", str(log),
                                         "--recover-failure-schedule",
                                         str(where / "schedule.yaml")],
                                 where / "status", timeout_s=timeout_s))
    if not result.succeeded or not log.exists():
        raise SystemExit(f"{arm}: the run failed\n{result.output[-3000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    if not all(r["invariant_ok"] and r["contributions"] == r["B"] for r in records):
        raise SystemExit(f"{arm}: the ledger invariant failed: {where}")
    (failure,) = [e for r in records for e in r["events"] if e["event"] == "failure"]
    if failure["g_ext"] != 1:
        raise SystemExit(f"{arm}: expected an extension pass of 1 microbatch, got {failure}")
    return {"extension_ms": (failure["restored"] - failure["repaired"]) * 1e3,
            "iteration_ms": statistics.median(r["iteration_ms"] for r in records
                                              if r["iteration"] >= 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "interleaved")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (
        lambda *a: print(*a, flush=True))
    runs = {arm: [] for arm in ARMS}
    for repeat in range(args.repeats):
        for arm in ARMS:
            runs[arm].append(one_run(arm, args.out / f"{arm}-{repeat}", args.timeout))
            say(f"{arm} #{repeat}: extension pass {runs[arm][-1]['extension_ms']:.1f} ms, "
                f"iteration {runs[arm][-1]['iteration_ms']:.1f} ms")
    summary = {arm: {key: statistics.median(run[key] for run in runs[arm])
                     for key in ("extension_ms", "iteration_ms")} for arm in ARMS}
    summary["extension_ratio"] = (summary["interleaved"]["extension_ms"]
                                  / summary["plain"]["extension_ms"])
    summary["iteration_ratio"] = (summary["interleaved"]["iteration_ms"]
                                  / summary["plain"]["iteration_ms"])
    summary["repeats"] = args.repeats
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for arm in ARMS:
            say(f"{arm:12s} extension pass of 1 microbatch {summary[arm]['extension_ms']:7.1f} ms"
                f"   failure-free iteration {summary[arm]['iteration_ms']:7.1f} ms"
                f"   (medians of {args.repeats})")
        say(f"interleaved / plain: extension pass {summary['extension_ratio']:.2f}, "
            f"iteration {summary['iteration_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
