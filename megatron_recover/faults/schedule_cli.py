"""`megatron-recover schedule`: write a seeded random failure schedule (YAML) for a run.

Example: `megatron-recover schedule --replicas 8 --ranks-per-replica 1 --seed 7 --count 3
--iterations 5:30 --locations during-reduce backward -o faults.yaml`. The same seed always
writes the same file; pass it to pretrain_gpt_recover.py as --recover-failure-schedule.
"""

import argparse
import sys
from pathlib import Path

from megatron_recover.faults.schedule import LOCATIONS, generate_schedule, write_schedule


def _iteration_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        return int(first), int(last if sep else first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (iterations), got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, required=True, help="replicas at launch")
    parser.add_argument("--ranks-per-replica", type=int, default=1,
                        help="ranks in one replica (TP x PP x intra-replica DP)")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--count", type=int, required=True, help="replicas to kill")
    parser.add_argument("--iterations", type=_iteration_range, required=True, metavar="A:B",
                        help="iterations the failures fall in (inclusive)")
    parser.add_argument("--locations", nargs="+", default=None, choices=LOCATIONS,
                        help="where failures may land (default: the locations every iteration "
                        "reaches)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="YAML file to write")


def run(args: argparse.Namespace) -> int:
    try:
        if args.replicas < 1 or args.ranks_per_replica < 1 or args.count < 1:
            raise ValueError("--replicas, --ranks-per-replica and --count must be >= 1")
        entries = generate_schedule(args.replicas, args.ranks_per_replica, args.count,
                                    args.seed, *args.iterations,
                                    tuple(args.locations) if args.locations else None)
    except ValueError as error:
        print(f"megatron-recover schedule: error: {error}", file=sys.stderr)
        return 2
    write_schedule(entries, args.output)
    for e in entries:
        print(f"iteration {e.iteration:5d}: replica {e.replica} local_rank {e.local_rank} "
              f"at {e.location}")
    print(f"wrote {args.output}")
    return 0
