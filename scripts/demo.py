"""`make demo`: a tiny Megatron GPT loses replicas mid-run and keeps its loss curve.

Usage: .venv/bin/python scripts/demo.py [--out runs/demo] [--replicas 8] [--iterations 36]
                                        [--precision fp32|bf16|fp16]

Builds a small corpus and a GPT-2 BPE tokenizer offline, preprocesses it into Megatron's
.bin/.idx, then runs the same job three times under `mpirun --with-ft ulfm` (8 replicas, one rank
each, CPU): a failure-free reference, `--recover` (static policy, exact mode) and
`--recover --recover-policy adaptive` (drop-and-go), the last two with the same failure schedule.
It prints a comparison, writes OUT/summary.json and OUT/loss_curves.png, and keeps every run's
per-iteration log, markers and schedule under OUT/<run>/.
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_recover.faults.schedule import (  # noqa: E402
    ScheduleEntry,
    injection_report,
    write_schedule,
)
from megatron_recover.launch import LaunchConfig, launch  # noqa: E402

RUN_TIMEOUT_S = 900
# Megatron's precision flags; fp16 starts its dynamic loss scale where this model's gradients do
# not overflow (Megatron's default 2**32 would skip the demo's first ~20 steps).
PRECISIONS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "65536"]}


def schedule(replicas: int, iterations: int) -> list[ScheduleEntry]:
    """Three failures: inside a bucket reduce; the replica holding global rank 0; and one more
    after the layout has no spare left for it (so it needs another extension pass)."""
    return [
        ScheduleEntry(iterations // 6, replicas - 1, 0, "during-reduce"),
        ScheduleEntry(iterations // 3, 0, 0, "backward"),
        ScheduleEntry(iterations // 2, replicas // 2, 0, "during-consensus"),
    ]


def job_arguments(data_dir: Path, iterations: int, replicas: int) -> list[str]:
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "1", "--global-batch-size", str(4 * replicas),
        "--train-iters", str(iterations), "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "3", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--seed", "1234", "--data-path", str(data_dir / "corpus_text_document"),
        "--split", "100,0,0", "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(data_dir / "vocab.json"), "--merge-file", str(data_dir / "merges.txt"),
        "--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--log-interval", "6",
    ]


def build_data(data_dir: Path) -> None:
    if (data_dir / "corpus_text_document.idx").exists():
        print(f"corpus: reusing {data_dir}")
        return
    print("corpus: building a synthetic corpus, tokenizer and .bin/.idx offline ...", flush=True)
    subprocess.run([sys.executable, str(ROOT / "scripts/make_demo_corpus.py"),
                    "--output-dir", str(data_dir)], check=True)


def run_job(name: str, out: Path, replicas: int, args: list[str]) -> list[dict]:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir / "log.jsonl"
    command = [sys.executable, str(ROOT / "pretrain_gpt_recover.py"), *args, "--recover",
               "--recover-log", str(log)]
    print(f"\n=== {name}: {' '.join(command[2:])}", flush=True)
    result = launch(LaunchConfig(replicas, command, run_dir / "status", RUN_TIMEOUT_S),
                    stream=True)
    (run_dir / "output.txt").write_text(result.output)
    if not result.succeeded:
        raise SystemExit(f"{name}: the run failed (see {run_dir}/output.txt)")
    return [json.loads(line) for line in log.read_text().splitlines()]


def plot(out: Path, runs: dict[str, list[dict]], precision: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    styles = {"reference": "k-", "recover": "C0--", "adaptive": "C3:"}
    for name, records in runs.items():
        its = [r["iteration"] for r in records]
        top.plot(its, [r["loss"] for r in records], styles[name], label=name)
        bottom.step(its, [r["live_replicas"] or 0 for r in records], styles[name], where="mid",
                    label=name)
    top.set_ylabel("lm loss")
    top.legend()
    top.set_title(f"Tiny GPT, 8 replicas, 3 failures, {precision} (CPU)")
    bottom.set_ylabel("live replicas")
    bottom.set_xlabel("iteration")
    path = out / "loss_curves.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def summarize(runs: dict[str, list[dict]], entries, marker_file: Path, replicas: int) -> dict:
    ref, rec, ada = runs["reference"], runs["recover"], runs["adaptive"]
    rel = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(rec, ref)]
    absd = [abs(a["loss"] - b["loss"]) for a, b in zip(rec, ref)]
    rel_ada = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(ada, ref)]
    report = injection_report(entries, marker_file, {(r, 0): r for r in range(replicas)})
    lost = {rep for r in rec for e in r["events"] if e["event"] == "failure"
            for rep in e["replicas"]}
    violations = sum(not (r["invariant_ok"] and r["contributions"] == r["B"]) for r in rec)
    return {
        "iterations": len(rec),
        "failures_injected": len(report["injected"]),
        "failures_not_injected": report["not_injected"],
        "failures_survived": len(lost) if len(rec) == len(ref) else 0,
        "reference_loss_drop": (ref[0]["loss"] - ref[-1]["loss"]) / ref[0]["loss"],
        "max_abs_loss_diff": max(absd),
        "max_rel_loss_diff": max(rel),
        "max_rel_loss_diff_adaptive": max(rel_ada),
        "invariant_violations": violations,
        "final_loss": {name: records[-1]["loss"] for name, records in runs.items()},
        "live_replicas_final": rec[-1]["live_replicas"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs/demo")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=36)
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    args = parser.parse_args()
    if args.replicas < 4 or args.iterations < 6:
        parser.error("the schedule needs --replicas >= 4 and --iterations >= 6")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    build_data(out / "data")
    job = job_arguments(out / "data", args.iterations, args.replicas) + PRECISIONS[args.precision]
    entries = schedule(args.replicas, args.iterations)
    schedule_file = out / "schedule.yaml"
    write_schedule(entries, schedule_file)

    runs = {"reference": run_job("reference", out, args.replicas, job)}
    failing = ["--recover-failure-schedule", str(schedule_file)]
    runs["recover"] = run_job("recover", out, args.replicas, job + failing)
    markers = out / "recover/log.markers.jsonl"
    runs["adaptive"] = run_job("adaptive", out, args.replicas,
                               job + failing + ["--recover-policy", "adaptive"])

    summary = {"precision": args.precision, **summarize(runs, entries, markers, args.replicas)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    png = plot(out, runs, args.precision)
    print("\n=== comparison (same job, same data, same failure schedule)")
    print(f"{'iter':>4} {'live':>4} {'reference':>12} {'recover':>12} {'adaptive':>12}"
          f" {'|d| recover':>12} {'contrib/B':>9}")
    for ref, rec, ada in zip(runs["reference"], runs["recover"], runs["adaptive"]):
        print(f"{ref['iteration']:>4} {rec['live_replicas']:>4} {ref['loss']:>12.6f}"
              f" {rec['loss']:>12.6f} {ada['loss']:>12.6f}"
              f" {abs(rec['loss'] - ref['loss']):>12.2e} {rec['contributions']:>4}/{rec['B']}")
    print(f"\nfailures injected (victim markers): {summary['failures_injected']}, survived: "
          f"{summary['failures_survived']}, not injected: {summary['failures_not_injected']}")
    print(f"reference loss drop: {summary['reference_loss_drop']:.1%}")
    print(f"max |loss - reference|: recover {summary['max_abs_loss_diff']:.2e} "
          f"(relative {summary['max_rel_loss_diff']:.2e}), adaptive relative "
          f"{summary['max_rel_loss_diff_adaptive']:.2e}")
    print(f"contributions == B in every iteration: {summary['invariant_violations'] == 0}")
    print(f"wrote {out / 'summary.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
