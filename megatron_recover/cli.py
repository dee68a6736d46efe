"""`megatron-recover` command line: `plan` (policy simulator), `launch` (mpirun composer),
`schedule` (seeded failure schedules) and `goodput` (ETTR at scale, simulated).

Each subcommand lives beside the layer it exposes; this module only dispatches, so importing it
pulls in neither torch nor MPI.
"""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-recover", description=__doc__.splitlines()[0])
    # Not dest="command": `launch` has a positional of that name (the program to run).
    sub = parser.add_subparsers(dest="subcommand", required=True)

    from megatron_recover.policy import plan_cli
    plan_cli.add_arguments(sub.add_parser("plan", help="simulate the workload policy under failures"))

    from megatron_recover import launch_cli
    launch_cli.add_arguments(sub.add_parser("launch",
                                            help="run a command under mpirun --with-ft ulfm"))

    from megatron_recover.faults import schedule_cli
    schedule_cli.add_arguments(sub.add_parser("schedule", help="write a seeded failure schedule"))

    from megatron_recover.goodput import cli as goodput_cli
    goodput_cli.add_arguments(sub.add_parser("goodput", help="simulate ETTR of fault-tolerance "
                                             "systems from 1k to 100k GPUs"))

    args = parser.parse_args(argv)
    commands = {"plan": plan_cli.run, "launch": launch_cli.run, "schedule": schedule_cli.run,
                "goodput": goodput_cli.run}
    return commands[args.subcommand](args)


if __name__ == "__main__":
    sys.exit(main())
