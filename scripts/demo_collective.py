"""Demo of layer 1: data-parallel SGD whose gradient all-reduce survives a rank dying inside it.

Usage: .venv/bin/python scripts/demo_collective.py [--ranks 4] [--steps 12] [--kill-step 5]
Launches the ranks with `megatron-recover launch`; rank 2 SIGKILLs itself inside the all-reduce
of --kill-step. Survivors get a failure record instead of a hang, the group is already repaired,
and they redo that step's reduction over the survivors (rewinding the gradient they had
snapshotted), agree in a consensus, and keep training with identical parameters.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path


def rank_main(args) -> None:
    import torch

    from megatron_recover import collective, runtime
    from megatron_recover.faults import Fault, FaultInjector

    ctx = runtime.init_distributed(status_dir=Path(os.environ["MEGATRON_RECOVER_STATUS_DIR"]))
    group = collective.new_group(list(range(ctx.world_size)))
    runtime.track_group(group)
    faults = [Fault(rank=2, point="reduce", occurrence=args.kill_step),
              Fault(rank=1, point="reduce", occurrence=args.kill_step, action="delay",
                    delay_s=0.3)]
    FaultInjector(faults, ctx.rank, Path(args.marker)).arm(group)

    torch.manual_seed(0)
    w_true = torch.randn(16)
    w = torch.zeros(16)
    for step in range(1, args.steps + 1):
        gen = torch.Generator().manual_seed(step * 1000 + ctx.rank)
        x = torch.randn(32, 16, generator=gen)
        grad = 2 * x.t() @ (x @ w - x @ w_true) / x.shape[0]
        snapshot = grad.clone()
        record = group.allreduce(grad).wait()
        while record.has_failure:
            # The reduction is not to be trusted; rewind and reduce over the new membership.
            print(f"[rank {ctx.rank}] step {step}: lost ranks {list(record.failed_ranks)}, "
                  f"epoch {record.epoch}, {record.size} left; re-reducing", flush=True)
            grad.copy_(snapshot)
            record = group.allreduce(grad).wait()
        agreed = group.consensus([1]).wait()
        w -= 0.05 * grad / agreed.census[0]
        loss = ((x @ w - x @ w_true) ** 2).mean().item()
        if group.rank == 0:
            print(f" step {step:3d} | live ranks {agreed.census[0]} | epoch {agreed.epoch} | "
                  f"local loss {loss:.5f} | |w| {w.norm().item():.6f}", flush=True)
    checksum = torch.tensor([float(w.sum())], dtype=torch.float64)
    out = torch.empty(group.size, dtype=torch.float64)
    group.allgather(out, checksum).wait()
    if group.rank == 0:
        same = bool(torch.all(out == out[0]))
        print(f"survivors {group.members}: parameters identical on all: {same}", flush=True)
    runtime.finish()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-step", type=int, default=5)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--marker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ranks < 3:
        parser.error("--ranks must be at least 3 (rank 2 is the victim)")
    if args.rank_main:
        return rank_main(args)

    from megatron_recover.launch import LaunchConfig, launch

    tmp = Path(tempfile.mkdtemp(prefix="demo-collective-"))
    cmd = [sys.executable, os.path.abspath(__file__), "--rank-main", "--ranks", str(args.ranks),
           "--steps", str(args.steps), "--kill-step", str(args.kill_step),
           "--marker", str(tmp / "markers.jsonl")]
    result = launch(LaunchConfig(args.ranks, cmd, tmp / "status", timeout_s=300), stream=True)
    print(f"kills that happened: {(tmp / 'markers.jsonl').read_text().strip() or 'none'}")
    print(f"run {'succeeded' if result.succeeded else 'FAILED'} in {result.elapsed_s:.1f}s "
          f"(logs and status files in {tmp})")
    return 0 if result.succeeded else 1


if __name__ == "__main__":
    sys.exit(main())
