"""`megatron-recover` command line: `plan` (policy simulator) and `launch` (mpirun composer).

Each subcommand lives beside the layer it exposes; this module only dispatches, so importing it
pulls in neither torch nor MPI.
"""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-recover", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    from megatron_recover.policy import plan_cli
    plan_cli.add_arguments(sub.add_parser("plan", help="simulate the workload policy under failures"))

    from megatron_recover import launch
    launch.add_arguments(sub.add_parser("launch", help="run a command under mpirun --with-ft ulfm"))

    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_cli.run(args)
    return launch.run(args)


if __name__ == "__main__":
    sys.exit(main())
