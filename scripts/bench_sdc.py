"""Sampled cross-replica verification: what it catches at each check rate, and what it costs.

Usage: .venv/bin/python scripts/bench_sdc.py [--json] [--rates 0,0.25,0.5,1] [--trials 40]
       [--ranks 4] [--iterations 30] [--rounds 1]

Three measurements, in one sitting:
  detection   For each rate, `--trials` seeded runs of the round protocol in one process
              (`testing.lockstep`: the real trainer, verification and policy over exact fake
              gradients), 4 replicas, 3 iterations, each with one bit flipped in one replica's
              gradient at a seeded iteration (the failure schedule's `bitflip`). A flip counts as
              detected when its replica was evicted and the survivors committed the failure-free
              gradients; as missed when the committed gradient held it. The expected rate is
              the check rate itself (a replica's pass is sampled with that probability).
  fingerprint Flips of a random bit (0-31) at a random element of an fp32 bucket of 2^20
              elements, a tenth of them zero (unused embedding rows): the share whose
              fingerprint changed, and the largest change of an element among those it missed.
  cost        The same tiny GPT job (mock data, CPU, `--ranks` replicas, --overlap-grad-reduce)
              failure-free at each rate, alternately, `--rounds` times: the median iteration
              time after warm-up and its ratio to rate 0 (no checks) from the same sitting.
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_overhead import WARMUP_ITERATIONS, run_mode  # noqa: E402
from megatron_recover.errors import SilentCorruption  # noqa: E402
from megatron_recover.faults.schedule import flip_bit  # noqa: E402
from megatron_recover.recovery.verification import Fingerprint  # noqa: E402
from megatron_recover.testing.lockstep import (  # noqa: E402
    Failure,
    Setup,
    failure_free_gradient,
    run_lockstep,
)

REPLICAS, MICROBATCHES, ITERATIONS = 4, 2, 3


def detection(rate: float, trials: int, seed: int) -> dict:
    """Seeded flips at `rate`: how many were caught before the commit, how many committed."""
    rng = random.Random(seed)
    caught = missed = 0
    for trial in range(trials):
        victim, iteration = rng.randrange(REPLICAS), rng.randint(1, ITERATIONS)
        setup = Setup(w_init=REPLICAS, g_init=MICROBATCHES, iterations=ITERATIONS,
                      sdc_check_rate=rate, seed=seed * 1000 + trial,
                      failures=(Failure(victim, iteration, "bitflip"),))
        runs, _ = run_lockstep(setup)
        survivor = next(r for r in range(REPLICAS) if r != victim)
        replica = runs[survivor].replica
        exact = all(torch.equal(replica.optimizer.stepped[t - 1],
                                failure_free_gradient(replica.audit, t))
                    for t in range(1, ITERATIONS + 1))
        if isinstance(runs[victim].error, SilentCorruption) and exact:
            caught += 1
        elif runs[victim].error is None and not exact:
            missed += 1
        else:
            raise SystemExit(f"rate {rate}, trial {trial}: neither caught nor committed "
                             f"({runs[victim].error!r}, exact {exact})")
    return {"trials": trials, "caught": caught, "committed": missed,
            "detection_rate": caught / trials}


def fingerprint_sensitivity(flips: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(1 << 20, generator=generator) * 1e-3
    grad[torch.rand(grad.numel(), generator=generator) < 0.1] = 0.0
    fingerprint = Fingerprint(seed)
    clean = fingerprint.bucket(0, grad)
    rng = random.Random(seed)
    seen, largest_missed = 0, 0.0
    for _ in range(flips):
        element, bit = rng.randrange(grad.numel()), rng.randrange(32)
        before = float(grad[element])
        flip_bit(grad[element:element + 1], bit)
        after = float(grad[element])
        if torch.equal(fingerprint.bucket(0, grad), clean):
            largest_missed = max(largest_missed, abs(after - before))
        else:
            seen += 1
        flip_bit(grad[element:element + 1], bit)  # back
    return {"flips": flips, "fingerprint_changed": seen / flips,
            "largest_missed_change": largest_missed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rates", default="0,0.25,0.5,1")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--flips", type=int, default=400)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    if 0.0 not in rates:
        parser.error("--rates must include 0: the costs are ratios to the run without checks")
    if args.iterations <= WARMUP_ITERATIONS:
        parser.error(f"--iterations must exceed the {WARMUP_ITERATIONS} warm-up iterations")
    report = {"detection": {}, "cost": {}}
    for rate in rates:
        print(f"detection at rate {rate:g}", file=sys.stderr, flush=True)
        report["detection"][f"{rate:g}"] = detection(rate, args.trials, args.seed)
    report["fingerprint"] = fingerprint_sensitivity(args.flips, args.seed)
    times = {rate: [] for rate in rates}
    with tempfile.TemporaryDirectory(prefix="bench-sdc-") as tmp:
        for round_index in range(args.rounds):
            for rate in rates:
                print(f"round {round_index + 1}/{args.rounds}: rate {rate:g}", file=sys.stderr,
                      flush=True)
                extra = ["--overlap-grad-reduce", "--recover", "--recover-hang-timeout", "0"]
                if rate > 0:
                    extra += ["--recover-sdc-check-rate", f"{rate:g}"]
                run = run_mode(f"rate-{rate:g}-{round_index}", extra, args.ranks,
                               args.iterations, Path(tmp))
                times[rate] += run["times"]
    base = statistics.median(times[0.0])
    for rate in rates:
        ms = statistics.median(times[rate])
        report["cost"][f"{rate:g}"] = {"median_ms": ms, "ratio_to_rate_0": ms / base,
                                       "iterations_measured": len(times[rate])}
    report.update(ranks=args.ranks, trials=args.trials, rounds=args.rounds)
    if args.json:
        print(json.dumps(report))
        return 0
    for rate in rates:
        d, c = report["detection"][f"{rate:g}"], report["cost"][f"{rate:g}"]
        print(f"rate {rate:4g}: caught {d['caught']}/{d['trials']} flips "
              f"({100 * d['detection_rate']:.0f}%), iteration time x{c['ratio_to_rate_0']:.2f}")
    f = report["fingerprint"]
    print(f"fingerprint changed by {100 * f['fingerprint_changed']:.1f}% of {f['flips']} random "
          f"flips; the largest change it missed: {f['largest_missed_change']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
