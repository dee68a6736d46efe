"""What the per-iteration ledger audit costs one rank: its expected side, read from the dataset.

Usage: .venv/bin/python scripts/bench_audit.py [--json] [--b 64,512] [--seq-length 1024]
       [--iterations 3]

Every rank's `LedgerAudit` checks each committed iteration against the failure-free one: it reads
the samples of all B microbatch ids of the iteration from megatron's `GPTDataset` and checksums
them (`data.batch_checksum`), on the training thread, after the commit. This measures that work
in one process, as a rank does it: for each B, `--iterations` fresh iterations (nothing cached),
mock data, micro-batch size 1, `--seq-length` tokens per sample; the seconds per iteration
(median) and the tokens read per second. The cost grows with B on every rank whatever the job's
size: at B = 1536 and 8k tokens a rank reads 12.6 M tokens per iteration.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_recover.megatron import run  # noqa: E402
from megatron_recover.megatron.arguments import parse_args  # noqa: E402
from megatron_recover.megatron.audit import LedgerAudit  # noqa: E402


def measure(b: int, seq_length: int, iterations: int) -> dict:
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(b),
            "--train-iters", str(iterations), "--lr", "1e-3", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    cfg = parse_args(argv, world_size=1, cuda_available=False)
    source, _ = run.microbatch_source(cfg)
    audit = LedgerAudit(source.dataset, global_batch_size=b, micro_batch_size=1,
                        main_samples=cfg.train_samples, policy="static", mode="exact")
    seconds = []
    for iteration in range(1, iterations + 1):
        start = time.perf_counter()
        sum(audit.checksum(iteration, k) for k in range(b))  # what `problems` reads
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    return {"B": b, "seq_length": seq_length, "seconds_per_iteration": round(median, 4),
            "tokens_per_second": round(b * seq_length / median),
            "seconds": [round(s, 4) for s in seconds]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--b", default="64,512", help="global batch sizes in microbatches")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    results = [measure(int(b), args.seq_length, args.iterations) for b in args.b.split(",")]
    if args.json:
        print(json.dumps({"audit": results}))
    else:
        for r in results:
            print(f"B = {r['B']}, {r['seq_length']} tokens per sample: "
                  f"{r['seconds_per_iteration'] * 1e3:.1f} ms per iteration per rank "
                  f"({r['tokens_per_second'] / 1e6:.2f} M tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
