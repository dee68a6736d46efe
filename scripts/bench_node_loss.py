"""Node loss: kill-to-resumed time from in-memory snapshots and from the on-disk checkpoint, and
what snapshots cost a failure-free iteration.

Usage (as root): .venv/bin/python scripts/bench_node_loss.py [--json] [--iterations 30]
       [--interval 10] [--pairs 5] [--overhead-ranks 1] [--out runs/node-loss]
       [--timeout 600] [--only overhead|node-loss]

One small GPT in exact mode under `megatron-recover launch --max-relaunches 1`, with the fake
nodes of megatron_recover.testing.nodes up (this machine and two fake nodes):

- Snapshot overhead: failure-free runs without and with --recover-snapshot-interval, alternated
  (--pairs of each), side by side on this machine alone with --overhead-ranks ranks: the wall
  time per iteration between the log records of iteration 5 and the last (snapshot copies
  included, which run between iterations), with/without per pair, their median and the best
  run of each side. By default one rank: its training thread has one core and the helper
  thread's write the other, as on a GPU node, where the write has cores of its own (6 ranks on
  these 2 cores ran the same failure-free job at 1.0 and at 2.0 s per iteration, a noise far
  above the effect). The runs with snapshots also measure the training thread's share alone
  (each writer's copy seconds, against the run's time).
- Kill-to-resumed, a 3-node job (2 ranks each, DP 6): nodeC is killed whole (all its processes
  and the host) once iteration `interval + 2` has committed; the launcher finds it lost and
  relaunches on the other two nodes, which resume from the newest snapshot, or, in the second
  run, from --save/--load's checkpoint written every `interval` iterations (the same interval:
  the same work at risk). Each is split into teardown (kill to mpirun's exit), relaunch and
  initialization (mpirun's start to the "resumed" line, the load excluded), the load, and the
  first iteration (the resumed line to the first committed iteration); iterations redone is
  the work lost.

Machine figures: 6 ranks share 2 cores, so start-up (importing torch and megatron-core in 6
processes) dominates the relaunch; on a cluster each rank has its own cores and the load and
teardown figures carry over more directly. Progress goes to stdout, or to stderr with --json,
which prints the summary (also written to OUT/summary.json). Exit status 0 when every run
ended as expected.
"""

import argparse
import json
import re
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_recover import relaunch  # noqa: E402
from megatron_recover.testing.nodes import AGENT, FakeNodes, unavailable_reason  # noqa: E402

RANKS_PER_NODE = 2
GPT = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
       "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
       "--global-batch-size", "12", "--lr", "3e-4", "--min-lr", "3e-5", "--clip-grad", "1.0",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
       "--eval-iters", "0", "--log-interval", "1", "--recover"]
_RESUMED = re.compile(r"resumed iteration (\d+) from .*\(([\d.]+) s\)")


def log(*args) -> None:
    print(*args, file=LOG, flush=True)


LOG = sys.stdout


def _iteration(status_dir: Path) -> int:
    return relaunch.read_progress(status_dir).get("iteration", 0)


def run(nodes: FakeNodes, work: Path, args, extra: list[str], kill_after: int | None,
        hosts: list[str] | None = None, ranks_per_host: int = RANKS_PER_NODE) -> dict:
    """One job under the relaunching launcher, on `hosts` (default: the three nodes); with
    `kill_after`, nodeC is killed whole once that iteration committed. Returns the attempts and
    the kill's time and iteration."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    command = [sys.executable, str(ROOT / "pretrain_gpt_recover.py"), *GPT,
               "--train-iters", str(args.iterations), "--recover-log", str(work / "log.jsonl"),
               *extra]
    loss = {}

    def on_start(attempt, job):
        if kill_after is None or attempt.number != 1:
            return

        def watch():
            status = work / "status" / "attempt-1"
            while attempt.ended == 0.0:
                if _iteration(status) >= kill_after:
                    loss["after"], loss["at"] = _iteration(status), time.time()
                    nodes.kill_node("nodeC")
                    return
                time.sleep(0.02)

        threading.Thread(target=watch, daemon=True).start()

    cfg = relaunch.JobConfig(
        command=command, hosts=hosts or nodes.hosts, ranks_per_host=ranks_per_host,
        status_root=work / "status", max_relaunches=1, timeout_s=args.timeout,
        ssh_agent=str(AGENT), network=nodes.cidr, env=tuple(nodes.env.items()))
    attempts = relaunch.run_job(cfg, on_start=on_start, log=log)
    records = {}
    for record in map(json.loads, (work / "log.jsonl").read_text().splitlines()):
        records[record["iteration"]] = record
    return {"attempts": attempts, "records": records, **loss}


def seconds_per_iteration(records: dict, first: int = 5) -> float:
    last = max(records)
    return (records[last]["time"] - records[first]["time"]) / (last - first)


def overhead(nodes: FakeNodes, out: Path, args) -> dict:
    """Side by side, alternated, on this machine alone with `--overhead-ranks` ranks (default 1:
    the training thread on one core, the helper thread's write on the other, as on a GPU node;
    6 ranks on 2 cores measured 1.0 and 2.0 s per iteration for the same failure-free run):
    wall time per iteration without and with snapshots, per pair, their median and the best
    run of each side; and inside the runs with snapshots, what the training thread spent
    copying, against the run's time."""
    hosts, ranks = nodes.hosts[:1], args.overhead_ranks
    pairs, on_path = [], []
    for i in range(args.pairs):
        without = run(nodes, out / f"plain-{i}", args, [], None, hosts, ranks)
        with_ = run(nodes, out / f"snapshots-{i}", args,
                    ["--recover-snapshot-interval", str(args.interval)], None, hosts, ranks)
        if not (without["attempts"][-1].succeeded and with_["attempts"][-1].succeeded):
            raise RuntimeError("a failure-free run failed")
        a, b = seconds_per_iteration(without["records"]), seconds_per_iteration(with_["records"])
        pairs.append({"without_s": round(a, 4), "with_s": round(b, 4), "ratio": round(b / a, 4)})
        records = with_["records"]
        span_s = records[max(records)]["time"] - records[min(records)]["time"]
        stats = [s["snapshots"] for s in with_["attempts"][-1].statuses.values()
                 if s.get("snapshots", {}).get("copy_s")]
        copy_s = max(sum(st["copy_s"]) for st in stats)  # the slowest writer's training thread
        on_path.append({"copy_s_per_snapshot": round(copy_s / len(stats[0]["copy_s"]), 4),
                        "write_s_per_snapshot": round(statistics.median(
                            w for st in stats for w in st["write_s"]), 4),
                        "ratio": round(1 + copy_s / span_s, 4)})
        log(f"overhead pair {i + 1} ({ranks} rank(s) on this machine): {a * 1e3:.1f} "
            f"ms/iteration without snapshots, {b * 1e3:.1f} ms with (interval {args.interval}): "
            f"ratio {b / a:.3f}; the training thread's copies: ratio {on_path[-1]['ratio']:.4f}")
    best = min(p["with_s"] for p in pairs) / min(p["without_s"] for p in pairs)
    return {"interval": args.interval, "ranks": ranks, "pairs": pairs,
            "ratio_median": round(statistics.median(p["ratio"] for p in pairs), 4),
            "ratio_best_of": round(best, 4), "training_thread": on_path,
            "training_thread_ratio_max": max(p["ratio"] for p in on_path)}


def breakdown(result: dict, source: str) -> dict:
    """Where the time from the kill to the first iteration committed after it went."""
    first, second = result["attempts"]
    resumed_at, iteration, load_s = None, None, None
    first_commit = None
    for at, line in second.lines:
        match = _RESUMED.search(line)
        if match and resumed_at is None and source in line:
            resumed_at, iteration, load_s = at, int(match.group(1)), float(match.group(2))
        elif resumed_at is not None and "consumed samples" in line:
            first_commit = at
            break
    if resumed_at is None or first_commit is None:
        raise RuntimeError(f"the relaunch did not resume from {source}:\n{second.summary()}")
    killed = result["at"]
    return {"killed_after_iteration": result["after"], "resumed_iteration": iteration,
            "iterations_redone": result["after"] - iteration,
            "teardown_s": round(first.ended - killed, 3),
            "relaunch_and_init_s": round(resumed_at - load_s - second.started, 3),
            "load_s": round(load_s, 3),
            "first_iteration_s": round(first_commit - resumed_at, 3),
            "launcher_gap_s": round(second.started - first.ended, 3),
            "kill_to_resumed_s": round(first_commit - killed, 3),
            "lost_hosts": first.lost}


def node_loss(out: Path, args) -> dict:
    """The same loss twice, on fresh nodes each time (the first loses nodeC for good)."""
    kill_after = args.interval + 2
    with FakeNodes(["nodeB", "nodeC"]) as nodes:
        snapshots = run(nodes, out / "kill-snapshots", args,
                        ["--recover-snapshot-interval", str(args.interval)], kill_after)
    ckpt = out / "kill-checkpoint" / "ckpt"
    with FakeNodes(["nodeB", "nodeC"]) as nodes:
        checkpoint = run(nodes, out / "kill-checkpoint", args,
                         ["--save", str(ckpt), "--load", str(ckpt), "--save-interval",
                          str(args.interval)], kill_after)
    figures = {"snapshot": breakdown(snapshots, "in-memory snapshots"),
               "checkpoint": breakdown(checkpoint, str(ckpt))}
    for name, f in figures.items():
        log(f"kill nodeC after iteration {f['killed_after_iteration']}, resume from {name} of "
            f"iteration {f['resumed_iteration']}: {f['kill_to_resumed_s']:.2f} s = teardown "
            f"{f['teardown_s']:.2f} + launcher {f['launcher_gap_s']:.2f} + relaunch/init "
            f"{f['relaunch_and_init_s']:.2f} + load {f['load_s']:.3f} + first iteration "
            f"{f['first_iteration_s']:.2f}")
    return figures


def main() -> int:
    global LOG
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--overhead-ranks", type=int, default=1,
                        help="ranks of the overhead runs, all on this machine")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "node-loss")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--only", choices=["overhead", "node-loss"], default=None,
                        help="run one of the two measurements")
    args = parser.parse_args()
    if args.json:
        LOG = sys.stderr
    reason = unavailable_reason()
    if reason:
        print(f"bench_node_loss: {reason}", file=sys.stderr)
        return 2
    if args.iterations < args.interval + 6:
        parser.error("--iterations must leave room after the kill: >= interval + 6")
    if args.pairs < 1 or args.overhead_ranks < 1:
        parser.error("--pairs and --overhead-ranks need at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    if args.only in (None, "overhead"):
        with FakeNodes(["nodeB", "nodeC"]) as nodes:
            summary["overhead"] = overhead(nodes, args.out, args)
    if args.only in (None, "node-loss"):
        summary["node_loss"] = node_loss(args.out, args)
        s, c = summary["node_loss"]["snapshot"], summary["node_loss"]["checkpoint"]
        summary["kill_to_resumed_ratio_checkpoint_over_snapshot"] = round(
            c["kill_to_resumed_s"] / s["kill_to_resumed_s"], 3)
    summary["ok"] = True
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
