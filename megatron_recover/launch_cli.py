"""`megatron-recover launch`: the command line over launch.py (one mpirun) and relaunch.py
(several hosts, relaunched after a lost node).

`-n N -- program ...` runs one mpirun and judges it by the ranks' status files (launch.py's
docstring); `--hostfile H` hands the job to relaunch.run_job. Exit status 0 when the run
succeeded, 1 when it failed, 2 for a command line to fix, 3 (errors.PROGRAM_ERROR_EXIT) when a
program error ended it (docs/failures.md).
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from megatron_recover import errors, relaunch
from megatron_recover.launch import LaunchConfig, launch, program_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--num-ranks", type=int, default=None,
                        help="MPI processes (with --hostfile: its slots)")
    hosts = parser.add_argument_group("several hosts (relaunch after a lost node)")
    hosts.add_argument("--hostfile", type=Path, default=None,
                       help="Open MPI hostfile (`host slots=N`, the same N on every host)")
    hosts.add_argument("--spare-hosts", default="",
                       help="comma-separated hosts that replace lost ones on a relaunch")
    hosts.add_argument("--max-relaunches", type=int, default=0,
                       help="relaunches after lost hosts (default 0)")
    hosts.add_argument("--ssh-agent", default=None,
                       help="PRRTE's remote launcher instead of ssh (plm_ssh_agent)")
    hosts.add_argument("--if-include", default=None, metavar="CIDR",
                       help="the hosts' network: MPI's and torch.distributed's traffic use it")
    hosts.add_argument("--stall-timeout", type=float, default=None,
                       help="seconds without a committed iteration after which the job counts "
                            f"as hung (default: {relaunch.STALL_FACTOR} x the command's "
                            "--recover-hang-timeout)")
    parser.add_argument("--status-dir", type=Path, default=None,
                        help="where ranks write their status files (default: a temporary "
                        "directory; with --hostfile, in the working directory, which every "
                        "host must see, where each host's /tmp is its own)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="hard limit, seconds")
    parser.add_argument("--mpirun", default=None, help="mpirun to use (default: the venv's)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program and its arguments")


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("megatron-recover launch: give the program after --", file=sys.stderr)
        return 2
    if args.hostfile is not None:
        return _run_on_hosts(args, command)
    if args.num_ranks is None or args.num_ranks < 1:
        print("megatron-recover launch: give --num-ranks >= 1 (or --hostfile)", file=sys.stderr)
        return 2
    status_dir = args.status_dir or Path(tempfile.mkdtemp(prefix="megatron-recover-"))
    cfg = LaunchConfig(args.num_ranks, command, status_dir, args.timeout, args.mpirun)
    result = launch(cfg, stream=True)
    if result.statuses:
        succeeded = result.succeeded
        summary = {rank: s.get("state") for rank, s in result.statuses.items()}
        basis = f"rank states {summary}; status files in {status_dir}"
    else:
        # A program that does not use megatron_recover.runtime writes no status: mpirun's
        # exit status is all there is.
        succeeded = result.returncode == 0
        basis = f"no rank wrote a status file; mpirun exited with {result.returncode}"
    verdict = "succeeded" if succeeded else "FAILED"
    print(f"megatron-recover launch: run {verdict} in {result.elapsed_s:.1f}s"
          f"{' (timed out)' if result.timed_out else ''}; {basis}")
    if args.status_dir is None and succeeded:
        shutil.rmtree(status_dir, ignore_errors=True)
    return 0 if succeeded else _failed(result.statuses)


def _failed(statuses: dict[int, dict]) -> int:
    """The exit status of a failed run: PROGRAM_ERROR_EXIT, saying where, after a program
    error; 1 otherwise."""
    ended = program_error(statuses)
    if ended is None:
        return 1
    rank, status = ended
    print(f"megatron-recover launch: a program error on rank {rank} ended the job "
          f"{errors.describe(status)}: {status['error'].strip().splitlines()[-1]}")
    return errors.PROGRAM_ERROR_EXIT


def _run_on_hosts(args: argparse.Namespace, command: list[str]) -> int:
    hosts = relaunch.read_hostfile(args.hostfile)
    slots = {n for _, n in hosts}
    if not hosts or len(slots) != 1:
        print(f"megatron-recover launch: --hostfile {args.hostfile}: give every host the same "
              "slots (ranks per host)", file=sys.stderr)
        return 2
    per_host = slots.pop()
    if args.num_ranks is not None and args.num_ranks != per_host * len(hosts):
        print(f"megatron-recover launch: --num-ranks {args.num_ranks} differs from the "
              f"hostfile's {per_host * len(hosts)} slots: drop --num-ranks", file=sys.stderr)
        return 2
    status_root = args.status_dir or Path(tempfile.mkdtemp(prefix="megatron-recover-status-",
                                                           dir=Path.cwd()))
    cfg = relaunch.JobConfig(
        command=command, hosts=[h for h, _ in hosts], ranks_per_host=per_host,
        status_root=status_root, spare_hosts=[h for h in args.spare_hosts.split(",") if h],
        max_relaunches=args.max_relaunches, timeout_s=args.timeout,
        stall_timeout_s=args.stall_timeout, ssh_agent=args.ssh_agent, network=args.if_include,
        mpirun=args.mpirun)
    attempts = relaunch.run_job(cfg, echo=True)
    succeeded = attempts[-1].succeeded
    print(f"megatron-recover launch: run {'succeeded' if succeeded else 'FAILED'} after "
          f"{len(attempts)} attempt(s); status files in {status_root}")
    return 0 if succeeded else _failed(attempts[-1].statuses)
