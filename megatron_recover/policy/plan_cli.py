"""`megatron-recover plan`: print what the workload policy does under a failure schedule.

Example (the paper's Figure 5): `megatron-recover plan --w-init 32 --g-init 8 --iterations 5
--fail 1:31 --fail 3:28 --json`. Bad input exits with status 2 and a message on stderr, like any
argparse error; nothing is printed on stdout then.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_recover.policy.layout import ADAPTIVE, EXACT, RESERVE, STATIC, PolicyConfig
from megatron_recover.policy.decisions import NoSurvivorsError
from megatron_recover.policy.replay import (
    IterationReport,
    parse_failure,
    parse_slow,
    simulate,
)
from megatron_recover.policy.speed import DEFAULT_WINDOW, StragglerConfig


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _failure(text: str):
    try:
        return parse_failure(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _slow(text: str):
    try:
        return parse_slow(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the `plan` flags on `parser`."""
    parser.add_argument(
        "--w-init", type=_positive_int, required=True, metavar="W", help="replicas at launch"
    )
    parser.add_argument(
        "--g-init",
        type=_positive_int,
        required=True,
        metavar="G",
        help="microbatches per replica per iteration at launch (B = W x G)",
    )
    parser.add_argument(
        "--iterations",
        type=_positive_int,
        required=True,
        metavar="N",
        help="simulate iterations 1..N",
    )
    parser.add_argument(
        "--policy",
        choices=(STATIC, ADAPTIVE),
        default=STATIC,
        help="static (default): the batch stays B; adaptive: drop-and-go, the batch shrinks",
    )
    parser.add_argument(
        "--mode",
        choices=(EXACT, RESERVE),
        default=None,
        help="static policy only: exact (default) recomputes lost ids, reserve drops them",
    )
    parser.add_argument(
        "--fail",
        type=_failure,
        action="append",
        default=[],
        metavar="ITER:REPLICA[,REPLICA...][@PHASE]",
        help="replicas (0-based) that die in iteration ITER (1-based); PHASE is reduce "
        "(default), extension (extensionN for the N-th extension pass) or commit; repeatable",
    )
    parser.add_argument(
        "--slow",
        type=_slow,
        action="append",
        default=[],
        metavar="REPLICA:FACTOR@FIRST[-LAST]",
        help="replica REPLICA takes FACTOR times as long per microbatch in iterations "
        "FIRST..LAST (to the end without LAST); repeatable. With --straggler-threshold the "
        "layout follows the speeds as --recover-straggler-threshold makes a run's follow them",
    )
    parser.add_argument("--straggler-threshold", type=float, default=0.0, metavar="F",
                        help="as --recover-straggler-threshold (default 0: off)")
    parser.add_argument("--straggler-window", type=int, default=DEFAULT_WINDOW, metavar="N",
                        help="as --recover-straggler-window (default %(default)s)")
    parser.add_argument("--evict-slower-than", type=float, default=0.0, metavar="X",
                        help="as --recover-evict-slower-than (default 0: never)")
    parser.add_argument("--json", action="store_true", help="one JSON object per iteration")


def run(args: argparse.Namespace) -> int:
    """Simulate and print; return the exit status (0, or 2 for input that cannot happen)."""
    try:
        if args.mode is not None and args.policy == ADAPTIVE:
            raise ValueError("--mode applies to the static policy only (adaptive has no spares)")
        straggler = StragglerConfig(args.straggler_threshold, args.straggler_window,
                                    args.evict_slower_than)
        config = PolicyConfig(args.w_init, args.g_init, args.policy, args.mode or EXACT,
                              straggler=straggler)
        reports = simulate(config, args.iterations, args.fail, args.slow)
    except (ValueError, NoSurvivorsError) as err:
        print(f"megatron-recover plan: error: {err}", file=sys.stderr)
        return 2
    try:
        if args.json:
            for report in reports:
                print(json.dumps(report.to_json()))
        else:
            print(_table(config, reports))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader (e.g. `| head`) left early; say nothing more and let the exit be quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


_COLUMNS = (
    ("iter", "iteration"),
    ("live", "live_replicas"),
    ("G", "grad_accum"),
    ("maj", "num_major"),
    ("min", "num_minor"),
    ("R", "minor_microbatches"),
    ("m-sp", "num_major_spare"),
    ("mi-sp", "num_minor_spare"),
    ("bdry-min", "num_boundary_minor"),
    ("boundary", "boundary"),
    ("extra", "extra_microbatches"),
    ("contrib", "contributions"),
    ("divisor", "divisor"),
)


def _table(config: PolicyConfig, reports: list[IterationReport]) -> str:
    """A readable table: one row per iteration, failures and promotions at the end of the row."""
    rows = []
    for report in reports:
        record = report.to_json()
        cells = [_cell(record[key]) for _, key in _COLUMNS]
        events = [f"{rep} died @{phase}" for rep, phase in record["failed"].items()]
        events += [
            f"{rep} (died after the last commit) handled"
            for rep in record["failures_handled"]
            if str(rep) not in record["failed"]
        ]
        events += [f"{spare} promoted for {dead}" for dead, spare in record["promoted"].items()]
        if config.straggler.enabled:
            events.append("first pass " + ",".join(f"{r}:{n}"
                                                   for r, n in record["first_pass"].items()))
            events += [f"slow {record['slow']}"] if record["slow"] else []
            events += [f"{r} evicted as a straggler" for r in record["evicted"]]
        rows.append(cells + ["; ".join(events)])
    header = [name for name, _ in _COLUMNS] + ["events"]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(_COLUMNS))]
    lines = [
        f"policy={config.policy} mode={config.mode} W_init={config.w_init} "
        f"G_init={config.g_init} B={config.b}"
    ]
    for row in [header] + rows:
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return "\n".join(line.rstrip() for line in lines)


def _cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)
