"""Failure-free cost of --recover and of its hang watchdog, measured side by side.

Usage: .venv/bin/python scripts/bench_overhead.py [--json] [--ranks 4] [--iterations 40]
       [--rounds 2] [--hang-timeout 3]

Runs the same tiny GPT job (mock data, CPU) in four modes, alternately, `--rounds` times each,
in one sitting (this machine is noisy): stock Megatron data parallelism on gloo; the same over
the ulfm backend without recovery (`--cross-replica-backend ulfm`); `--recover` with the hang
watchdog off (snapshots, commit lane, consensus, policy); and `--recover --recover-hang-timeout T` (Open MPI's failure
detector thread heartbeating every T/2 s, the replica gate). Reports the median per-iteration
time of each, skipping warm-up iterations, and the ratios recover / stock, recover /
ulfm-without-recovery and watchdog on / off.
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

WARMUP_ITERATIONS = 5
ITERATION_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): "
                          r"([0-9.]+)")


def job(iterations: int, ranks: int) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--global-batch-size", str(4 * ranks), "--train-iters", str(iterations),
            "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "256", "--log-interval", "1"]


def iteration_times(mode: str, ranks: int, iterations: int, hang_timeout: float,
                    tmp: Path) -> list[float]:
    extra = {"stock": [], "ulfm": ["--cross-replica-backend", "ulfm"],
             "recover": ["--recover", "--recover-hang-timeout", "0"],
             "watchdog": ["--recover", "--recover-hang-timeout", f"{hang_timeout:g}"]}[mode]
    command = [sys.executable, str(ROOT / "pretrain_gpt_recover.py"),
               *job(iterations, ranks), *extra]
    result = launch(LaunchConfig(ranks, command, tmp / f"status-{mode}", timeout_s=900))
    if not result.succeeded:
        raise SystemExit(f"{mode} run failed:\n{result.output[-3000:]}")
    times = {int(it): float(ms) for it, ms in ITERATION_MS.findall(result.output)}
    return [times[i] for i in sorted(times) if i > WARMUP_ITERATIONS]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hang-timeout", type=float, default=3.0,
                        help="--recover-hang-timeout of the watchdog mode (the tests' value: "
                             "the shortest heartbeat period, so the largest cost)")
    args = parser.parse_args()
    if args.iterations <= WARMUP_ITERATIONS:
        parser.error(f"--iterations must exceed the {WARMUP_ITERATIONS} warm-up iterations "
                     "that are not measured")
    samples = {"stock": [], "ulfm": [], "recover": [], "watchdog": []}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        for round_index in range(args.rounds):
            for mode in samples:
                print(f"round {round_index + 1}/{args.rounds}: {mode}", file=sys.stderr,
                      flush=True)
                samples[mode] += iteration_times(mode, args.ranks, args.iterations,
                                                 args.hang_timeout, Path(tmp))
    medians = {mode: statistics.median(times) for mode, times in samples.items()}
    report = {"ranks": args.ranks, "iterations_measured": {m: len(t) for m, t in samples.items()},
              "stock_ms": medians["stock"], "ulfm_without_recovery_ms": medians["ulfm"],
              "recover_ms": medians["recover"],
              "ratio": medians["recover"] / medians["stock"],
              "ratio_vs_ulfm_without_recovery": medians["recover"] / medians["ulfm"],
              "hang_timeout_s": args.hang_timeout, "watchdog_ms": medians["watchdog"],
              "watchdog_ratio": medians["watchdog"] / medians["recover"]}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"median iteration time, {args.ranks} ranks, failure-free: stock (gloo) "
              f"{report['stock_ms']:.1f} ms, stock over ulfm "
              f"{report['ulfm_without_recovery_ms']:.1f} ms, --recover "
              f"{report['recover_ms']:.1f} ms; recover/stock {report['ratio']:.3f}, "
              f"recover/ulfm {report['ratio_vs_ulfm_without_recovery']:.3f}")
        print(f"hang watchdog ({args.hang_timeout:g} s): on {report['watchdog_ms']:.1f} ms vs "
              f"off {report['recover_ms']:.1f} ms; on/off {report['watchdog_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
