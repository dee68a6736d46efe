"""`make fault-campaign N=30 SEED=1`: N seeded failure schedules, each against the failure-free
reference of its configuration (megatron_recover/faults/campaign.py says what a case draws and
what it must hold).

Usage: .venv/bin/python scripts/fault_campaign.py [--cases 30] [--seed 1] [--case K]
                                                   [--first K] [--out runs/fault-campaign]
                                                   [--plane torch|mpi]

Prints one line per case (its seed, configuration, schedule and verdict; `--case K` reruns it),
then one JSON line: cases, failures_injected, failures_survived, max_rel_loss_diff,
max_rel_param_diff, ledger_violations, seed, data_plane, wall_s (and the negative control, the scenarios
reached, the failed cases). Exit status 1 when a case failed or the negative control stayed
within the tolerance. Each run's directory under --out is replaced; nothing else is removed.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_recover.faults.campaign import run_campaign  # noqa: E402
from megatron_recover.testing.compare import EXACT_RTOL  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--case", type=int, default=None, help="rerun only this case of --seed")
    parser.add_argument("--first", type=int, default=0,
                        help="start at this case (a long campaign in parts: cases --first to "
                             "--cases - 1)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/fault-campaign")
    parser.add_argument("--plane", choices=["torch", "mpi"], default=None,
                        help="every run's --recover-data-plane (default: the default plane)")
    args = parser.parse_args()
    if not 0 <= args.first < args.cases:
        parser.error("need 0 <= --first < --cases")
    summary = run_campaign(args.cases, args.seed, args.out.resolve(), only=args.case,
                           log=lambda line: print(line, flush=True), first=args.first,
                           plane=args.plane)
    print(json.dumps(summary))
    control_caught = summary["negative_control_rel_loss_diff"] > 100 * EXACT_RTOL
    return 0 if not summary["failed_cases"] and control_caught else 1


if __name__ == "__main__":
    sys.exit(main())
