"""Failure-free cost of --recover, overlapped and deferred, and of its hang watchdog, side by side.

Usage: .venv/bin/python scripts/bench_overhead.py [--json] [--ranks 4] [--iterations 40]
       [--rounds 2] [--hang-timeout 3] [--size tiny|mid|compute] [--modes M,...] [--precisions P,...]

Runs the same GPT job (mock data, CPU, data parallelism over `--ranks` replicas; `--size`
tiny: 2 layers, hidden 64, sequence 64, where communication and bookkeeping dominate; compute:
4 layers, hidden 512, sequence 512, where the compute does, as on a real job; mid: 4 layers,
hidden 256, sequence 256, compute-dominated too, for bf16, whose matmuls on this CPU take about
100 s per iteration at the compute size) in these
modes, alternately, `--rounds` times each, in one sitting (this machine is noisy):
  stock           Megatron as a stock user runs it: gloo, --overlap-grad-reduce
  stock-ulfm      the same over the ulfm backend, no recovery (--cross-replica-backend ulfm)
  deferred        --recover without --overlap-grad-reduce: every bucket after the schedule
  overlapped      --recover --overlap-grad-reduce: buckets posted during backward, on the
                  default data plane (torch: gloo here; docs/data-planes.md)
  overlapped-mpi  the same on the mpi data plane (--recover-data-plane mpi)
each in fp32 and in bf16, plus `watchdog` (overlapped, fp32, --recover-hang-timeout T: Open
MPI's failure detector heartbeating every T/2 s and the replica gate; the other --recover modes
run with the watchdog off). Reports the median per-iteration time of each, skipping warm-up
iterations, and the ratios. From the recovery log of the --recover runs (the ulfm worker's
timestamps of every bucket reduction of the first round): `reduce_share`, the share of the
iteration during which some cross-replica reduction was running, and `hidden_share`, the part of
that time before megatron's schedule returned (hidden under backward), both for the overlapped
fp32 runs (and the deferred ones for comparison); `snapshot_bytes_ratio`, snapshot memory per
rank over its gradient buffer. `--modes` and `--precisions` run a subset (the compute size's
iterations take seconds, bf16 ones on this CPU several times fp32's); the report then has the
ratios whose modes ran.
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
MODES = {
    "stock": ["--overlap-grad-reduce"],
    "stock-ulfm": ["--overlap-grad-reduce", "--cross-replica-backend", "ulfm"],
    "deferred": ["--recover", "--recover-hang-timeout", "0"],
    "overlapped": ["--overlap-grad-reduce", "--recover", "--recover-hang-timeout", "0"],
    # The same on the mpi data plane (`overlapped` runs on the default plane: torch, gloo here).
    "overlapped-mpi": ["--overlap-grad-reduce", "--recover", "--recover-hang-timeout", "0",
                       "--recover-data-plane", "mpi"],
}
PRECISIONS = {"fp32": [], "bf16": ["--bf16"]}


# --size: (layers, hidden size, attention heads, sequence length)
SIZES = {"tiny": (2, 64, 4, 64), "mid": (4, 256, 4, 256), "compute": (4, 512, 8, 512)}


def job(iterations: int, ranks: int, size: str = "tiny") -> list[str]:
    layers, hidden, heads, seq = SIZES[size]
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--eval-iters", "0",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "1",
            "--global-batch-size", str(4 * ranks), "--train-iters", str(iterations),
            "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "256", "--log-interval", "1", "--ddp-bucket-size", "20000"]


def run_mode(name: str, extra: list[str], ranks: int, iterations: int, tmp: Path,
             size: str = "tiny") -> dict:
    """One run: its per-iteration times after warm-up and, under --recover, its log records."""
    where = tmp / name
    log = where / "log.jsonl"
    recover = ["--recover-log", str(log)] if "--recover" in extra else []
    command = [sys.executable, str(ROOT / "pretrain_gpt_recover.py"),
               *job(iterations, ranks, size), *extra, *recover]
    result = launch(LaunchConfig(ranks, command, where / "status", timeout_s=900))
    if not result.succeeded:
        raise SystemExit(f"{name} run failed:\n{result.output[-3000:]}")
    times = {int(it): float(ms) for it, ms in ITERATION_MS.findall(result.output)}
    records = [json.loads(line) for line in log.read_text().splitlines()] if recover else []
    return {"times": [times[i] for i in sorted(times) if i > WARMUP_ITERATIONS],
            "records": [r for r in records if r["iteration"] > WARMUP_ITERATIONS]}


def shares(records: list[dict]) -> tuple[float, float]:
    """(reduce_share, hidden_share) over the records, from their summed timestamps."""
    reduce_ms = sum(r["reduction"]["reduce_ms"] for r in records)
    hidden_ms = sum(r["reduction"]["hidden_ms"] for r in records)
    iteration_ms = sum(r["iteration_ms"] for r in records)
    return reduce_ms / iteration_ms, hidden_ms / reduce_ms if reduce_ms else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hang-timeout", type=float, default=3.0,
                        help="--recover-hang-timeout of the watchdog mode (the tests' value: "
                             "the shortest heartbeat period, so the largest cost)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--modes", default=",".join([*MODES, "watchdog"]),
                        help="comma-separated subset of: " + ", ".join([*MODES, "watchdog"]))
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help="comma-separated subset of: " + ", ".join(PRECISIONS))
    args = parser.parse_args()
    chosen, precisions = args.modes.split(","), args.precisions.split(",")
    unknown = sorted(set(chosen) - {*MODES, "watchdog"}) + sorted(set(precisions) - set(PRECISIONS))
    if unknown:
        parser.error(f"unknown modes or precisions: {unknown}")
    if args.iterations <= WARMUP_ITERATIONS:
        parser.error(f"--iterations must exceed the {WARMUP_ITERATIONS} warm-up iterations "
                     "that are not measured")
    modes = {f"{mode}-{precision}": [*flags, *PRECISIONS[precision]]
             for precision in precisions for mode, flags in MODES.items() if mode in chosen}
    if "watchdog" in chosen:
        modes["watchdog-fp32"] = ["--overlap-grad-reduce", "--recover",
                                  "--recover-hang-timeout", f"{args.hang_timeout:g}"]
    runs = {name: {"times": [], "records": []} for name in modes}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        for round_index in range(args.rounds):
            for name, extra in modes.items():
                print(f"round {round_index + 1}/{args.rounds}: {name}", file=sys.stderr,
                      flush=True)
                run = run_mode(f"{name}-{round_index}", extra, args.ranks, args.iterations,
                               Path(tmp), args.size)
                runs[name]["times"] += run["times"]
                runs[name]["records"] += run["records"]
    ms = {name: statistics.median(run["times"]) for name, run in runs.items()}

    def ratio(a: str, b: str) -> float | None:
        return ms[a] / ms[b] if a in ms and b in ms else None

    report = {
        "ranks": args.ranks, "size": args.size,
        "iterations_measured": {name: len(run["times"]) for name, run in runs.items()},
        "median_ms": ms,
        "ratio_overlap_vs_stock": ratio("overlapped-fp32", "stock-fp32"),
        "ratio_overlap_vs_stock_bf16": ratio("overlapped-bf16", "stock-bf16"),
        "ratio_deferred_vs_stock": ratio("deferred-fp32", "stock-fp32"),
        "ratio_deferred_vs_stock_bf16": ratio("deferred-bf16", "stock-bf16"),
        "ratio_overlap_vs_deferred": ratio("overlapped-fp32", "deferred-fp32"),
        "ratio_overlap_vs_deferred_bf16": ratio("overlapped-bf16", "deferred-bf16"),
        "ratio_overlap_vs_stock_ulfm": ratio("overlapped-fp32", "stock-ulfm-fp32"),
        "ratio_stock_ulfm_vs_stock": ratio("stock-ulfm-fp32", "stock-fp32"),
        "ratio_overlap_mpi_plane_vs_stock": ratio("overlapped-mpi-fp32", "stock-fp32"),
        "ratio_overlap_torch_vs_mpi_plane": ratio("overlapped-fp32", "overlapped-mpi-fp32"),
        "hang_timeout_s": args.hang_timeout,
        "watchdog_ratio": ratio("watchdog-fp32", "overlapped-fp32"),
    }
    for name, key in (("overlapped", ""), ("deferred", "deferred_")):
        runs_of = [run for mode, run in runs.items()
                   if mode.startswith(name) and not mode.startswith("overlapped-mpi")]
        if runs_of:
            records = runs.get(f"{name}-fp32", runs_of[0])["records"]
            report[f"{key}reduce_share"], report[f"{key}hidden_share"] = shares(records)
            last = records[-1]["reduction"]
            report["snapshot_bytes_ratio"] = last["snapshot_bytes"] / last["grad_bytes"]
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"median iteration time, {args.ranks} ranks, {args.size} size, failure-free (ms):")
    for precision in precisions:
        print(f"  {precision}: " + ", ".join(f"{mode} {ms[f'{mode}-{precision}']:.1f}"
                                               for mode in MODES if f"{mode}-{precision}" in ms))
    for key, value in report.items():
        if key.startswith("ratio") or key.endswith("share") or key == "snapshot_bytes_ratio":
            if value is not None:
                print(f"  {key}: {value:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
