"""What the per-iteration ledger audit costs one rank: its expected side, read from the dataset.

Usage: .venv/bin/python scripts/bench_audit.py [--json] [--b 64,512] [--seq-length 1024]
       [--iterations 3] [--contributors 8]

The `DatasetAudit` checks each committed iteration against the failure-free one from the
samples of its B microbatch ids, read from megatron's `GPTDataset` and checksummed
(`data.batch_checksum`). Read by one rank, that is all B ids (`all`: what every rank did
before the expected side was shared); shared, each of the lane's contributors (the live
replicas at a position, times the replica's shards) reads the ids of its share
(`DatasetAudit.share`) before the commit lane, which sums the shares. This measures both in one
process, side by side, as a rank does them: for each B, `--iterations` fresh iterations (nothing
cached), mock data, micro-batch size 1, `--seq-length` tokens per sample; the seconds per
iteration (median), and the share of index 0 among `--contributors`.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_recover.megatron.app import run  # noqa: E402
from megatron_recover.megatron.config.arguments import parse_args  # noqa: E402
from megatron_recover.megatron.data.audit import DatasetAudit  # noqa: E402


def measure(b: int, seq_length: int, iterations: int, contributors: int) -> dict:
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(b),
            "--train-iters", str(iterations), "--lr", "1e-3", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    cfg = parse_args(argv, world_size=1, cuda_available=False)
    source, _ = run.microbatch_source(cfg)
    def audit():
        return DatasetAudit(source.dataset, global_batch_size=b, micro_batch_size=1,
                           main_samples=cfg.train_samples, policy="static", mode="exact")

    reading_all, sharing = audit(), audit()  # separate caches: each reads what it needs
    seconds = {"all": [], "share": []}
    for iteration in range(1, iterations + 1):
        start = time.perf_counter()
        sum(reading_all.checksum(iteration, k) for k in range(b))  # every id, on one rank
        seconds["all"].append(time.perf_counter() - start)
        start = time.perf_counter()
        sharing.share(iteration, 0, contributors)
        seconds["share"].append(time.perf_counter() - start)
    all_s, share_s = (statistics.median(seconds[k]) for k in ("all", "share"))
    return {"B": b, "seq_length": seq_length, "contributors": contributors,
            "all_seconds_per_iteration": round(all_s, 4),
            "share_seconds_per_iteration": round(share_s, 4),
            "ratio": round(share_s / all_s, 3),
            "tokens_per_second": round(b * seq_length / all_s)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--b", default="64,512", help="global batch sizes in microbatches")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--contributors", type=int, default=8,
                        help="the lane's contributors sharing the expected side")
    args = parser.parse_args()
    results = [measure(int(b), args.seq_length, args.iterations, args.contributors)
               for b in args.b.split(",")]
    if args.json:
        print(json.dumps({"audit": results}))
    else:
        for r in results:
            print(f"B = {r['B']}, {r['seq_length']} tokens per sample: every id "
                  f"{r['all_seconds_per_iteration'] * 1e3:.1f} ms per iteration "
                  f"({r['tokens_per_second'] / 1e6:.2f} M tokens/s), a share of "
                  f"{r['contributors']} {r['share_seconds_per_iteration'] * 1e3:.1f} ms "
                  f"(ratio {r['ratio']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
