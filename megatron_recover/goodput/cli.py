"""`megatron-recover goodput`: ETTR of each fault-tolerance system at scale (simulated), and
`--validate` against published figures. See megatron_recover.goodput.simulator for the model.
"""

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

from megatron_recover.goodput import anchors
from megatron_recover.goodput import simulator as sim

DEFAULT_GPUS = "1000,4000,16000,64000,100000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", default=DEFAULT_GPUS, help="GPU counts (comma-separated)")
    parser.add_argument("--gpus-per-replica", type=int, default=sim.Job.gpus_per_replica,
                        help="TP x PP x CP GPUs a failure takes down (default: Llama 3 405B's)")
    parser.add_argument("--iteration-s", type=float, default=sim.Job.iteration_s,
                        help="failure-free iteration time, seconds")
    parser.add_argument("--microbatches-per-replica", type=int,
                        default=sim.Job.microbatches_per_replica,
                        help="G, each replica's microbatches per iteration (B = G x replicas)")
    parser.add_argument("--tokens-per-microbatch", type=int,
                        default=sim.Job.tokens_per_microbatch)
    parser.add_argument("--regrow-hours", type=float, default=None,
                        help="recover+restarts' period of planned restarts at full size "
                             "(default: the one balancing their cost and the capacity lost)")
    parser.add_argument("--gpu-mtbf-hours", type=float, default=None,
                        help="constant per-GPU failure rate (one GPU's MTBF); default: the "
                             "published job MTBF against scale")
    parser.add_argument("--hang-share", type=float, default=0.0,
                        help="share of failures that are hangs, noticed after the hang timeout")
    parser.add_argument("--checkpoint-interval", type=int, default=None,
                        help="iterations between checkpoints (default: Young/Daly per system)")
    parser.add_argument("--standbys", type=int, default=None,
                        help="K standby replicas of recover+standbys (default: twice the "
                             "failures expected during one replacement)")
    parser.add_argument("--days", type=float, default=14.0, help="simulated run length")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3, help="seeds averaged per point")
    for f in fields(sim.Costs):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=float, default=None,
                            help=f"event cost (default {f.default})")
    parser.add_argument("--from-log", type=Path, default=None,
                        help="take recover's event costs from a recovery log (runs/.../log.jsonl)")
    parser.add_argument("--validate", action="store_true",
                        help="check the simulator against the published anchors")
    parser.add_argument("--bench-summary", type=Path, default=None,
                        help="the CPU benchmark summary the cpu-benchmark anchor reads (default: "
                             "runs/bench/summary.json if `make bench-restart` wrote one, else the "
                             "run recorded in docs/results/bench_vs_restart.json)")
    parser.add_argument("--plot", type=Path, default=None, help="write ETTR against GPU count")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _costs(args) -> tuple[sim.Costs, dict | None]:
    changes = {f.name: getattr(args, f.name) for f in fields(sim.Costs)
               if getattr(args, f.name) is not None}
    costs = replace(sim.Costs(), **changes)
    measured = None
    if args.from_log is not None:
        costs, measured = anchors.costs_from_log(args.from_log, costs)
    return costs, measured


def run(args: argparse.Namespace) -> int:
    try:
        costs, measured = _costs(args)
        if args.validate:
            return _validate(args, costs)
        gpus = [int(x) for x in args.gpus.split(",")]
        if args.runs < 1 or args.days <= 0:
            raise ValueError("--runs must be >= 1 and --days > 0")
        if not 0.0 <= args.hang_share <= 1.0:
            raise ValueError("--hang-share must be in [0, 1]")
        jobs = [sim.Job(n, args.gpus_per_replica, args.iteration_s,
                        args.microbatches_per_replica, args.tokens_per_microbatch) for n in gpus]
    except (ValueError, OSError) as error:
        print(f"megatron-recover goodput: {error}", file=sys.stderr)
        return 2
    model = sim.FailureModel(gpu_mtbf_hours=args.gpu_mtbf_hours, hang_share=args.hang_share)
    horizon = args.days * sim.DAY_S
    points, kept = [], {}
    for job in jobs:
        regrow = None if args.regrow_hours is None else args.regrow_hours * sim.HOUR_S
        runs = [sim.simulate(job, model, costs, horizon, args.seed + k, standbys=args.standbys,
                             interval=args.checkpoint_interval, regrow_s=regrow)
                for k in range(args.runs)]
        kept[job.gpus] = runs[0]
        points.append({"gpus": job.gpus, "replicas": job.replicas,
                       "job_mtbf_min": round(model.job_mtbf_s(job.training_gpus) / 60, 2),
                       "systems": sim.summarize(job, runs)})
    report = {"assumptions": {"failure_model": model.describe(),
                              "hang_share": args.hang_share, "days": args.days,
                              "runs": args.runs, "seed": args.seed,
                              "job": {"gpus_per_replica": args.gpus_per_replica,
                                      "iteration_s": args.iteration_s,
                                      "microbatches_per_replica": args.microbatches_per_replica,
                                      "tokens_per_microbatch": args.tokens_per_microbatch},
                              "regrow_hours": args.regrow_hours,
                              "costs": {f.name: getattr(costs, f.name) for f in fields(costs)}},
              "results": points}
    if measured is not None:
        report["assumptions"]["measured_from_log"] = {"log": str(args.from_log), **measured}
    if args.plot is not None:
        report["figure"] = str(plot(args.plot, points, kept))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


def _validate(args, costs: sim.Costs) -> int:
    summary = args.bench_summary or anchors.default_bench_summary()
    lines = anchors.validate(summary, costs)
    for line in lines:
        if args.json:
            print(json.dumps(line))
        else:
            print(f"{line['name']:>16}: target {line['target']} simulated {line['simulated']} "
                  f"({line['kind']} {line['tolerance']}) {'ok' if line['ok'] else 'NOT OK'}"
                  + (f" - {line['note']}" if "note" in line else ""))
    return 0 if all(line["ok"] for line in lines) else 1


def print_table(report: dict) -> None:
    systems = list(report["results"][0]["systems"])
    print("ETTR (committed tokens / allocated GPU-time, against failure-free), "
          + report["assumptions"]["failure_model"])
    print(f"{'GPUs':>8} {'MTBF min':>9} " + " ".join(f"{s:>18}" for s in systems))
    for point in report["results"]:
        print(f"{point['gpus']:>8} {point['job_mtbf_min']:>9} "
              + " ".join(f"{point['systems'][s]['ettr']:>18.3f}" for s in systems))
    last = report["results"][-1]["systems"]
    for s in systems:
        keeps = "keeps B and the trajectory" if last[s]["keeps_trajectory"] else "B shrinks"
        print(f"  {s}: {keeps}; live replicas at the end {last[s]['live_replicas_final']} of "
              f"{last[s]['replicas']}" + (f", {last[s]['standbys']} standbys"
                                           if "standbys" in last[s] else ""))


def plot(path: Path, points: list[dict], kept: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(points[0]["systems"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    gpus = [p["gpus"] for p in points]
    for s in systems:
        left.plot(gpus, [p["systems"][s]["ettr"] for p in points], "o-", label=s)
    left.set_xscale("log")
    left.set_xlabel("GPUs")
    left.set_ylabel("ETTR")
    left.set_ylim(0, 1)
    left.legend(fontsize=8)
    left.set_title("ETTR against GPU count")
    largest = max(kept)
    for s, result in kept[largest].items():
        if result.interval is not None:  # the restart systems: all replicas but while down
            continue
        xs, ys = zip(*result.live_replicas)
        right.step([x / sim.DAY_S for x in xs], ys, where="post", label=s)
    right.set_xlabel("days")
    right.set_ylabel("live replicas")
    right.set_title(f"{largest} GPUs, first seed (restart systems: all replicas, "
                    "none while down)", fontsize=9)
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
