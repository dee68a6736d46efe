"""All-reduce time of the ulfm backend vs torch's gloo, 16-bit against fp32, and time from a kill
to a repaired group.

Usage: .venv/bin/python scripts/bench_collective.py [--json] [--reps-scale X]
Both backends run in the same processes, alternating per repetition (this machine is noisy), and
the table reports medians and the ulfm/gloo ratio. The ulfm all-reduce of fp32 and bf16 tensors
of the same bytes (DTYPE_SIZES_MIB, 2 ranks, one per core) alternate the same way; GB/s is the
tensor's bytes over the median time (the rate at which the gradient buffer is reduced); fp32
again staged through the group's host buffers (`set_stage_host`: the copy in and the copy back
that a CUDA tensor's reduction makes, here host to host). Repair time: one rank SIGKILLs itself after a
barrier; the survivors' all-reduce returns a failure record once the group is repaired; we report
the largest survivor time from the victim's marker to that return. The data planes
(docs/data-planes.md): the mpi plane's all-reduce against the torch plane's at PLANE_SIZES_MIB,
fp32 and bf16, alternating in the same processes; and each plane's time from a kill to the failed
all-reduce and to the consensus after it, which repairs the torch plane.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MIB = 1 << 20
SIZES_MIB = (1, 16, 128)
BANDWIDTH_RANKS = (2, 4)
REPAIR_RANKS = (2, 4, 8, 16)
DTYPE_SIZES_MIB = (16, 256)
DTYPE_RANKS = 2
PLANE_SIZES_MIB = (1, 16, 256)
PLANE_REPS = {1: 30, 16: 8, 256: 3}
PLANE_RANKS = 2


def reps_for(size_mib: int, scale: float) -> int:
    return max(3, int({1: 30, 16: 8, 128: 4}[size_mib] * scale))


def groups():
    """(context, ulfm group, gloo group) over every rank of this worker's job."""
    import torch.distributed as dist

    from megatron_recover import collective, runtime

    ctx = runtime.init_distributed()
    ulfm = collective.new_group(list(range(ctx.world_size)))
    runtime.track_group(ulfm)
    return ctx, ulfm, dist.new_group(list(range(ctx.world_size)), backend="gloo")


def worker_bandwidth(out: Path, scale: float) -> None:
    import torch
    import torch.distributed as dist

    from megatron_recover import runtime

    ctx, ulfm, gloo = groups()
    rows = []
    for size_mib in SIZES_MIB:
        t = torch.ones(size_mib * MIB // 4)
        times = {"ulfm": [], "gloo": []}
        for rep in range(reps_for(size_mib, scale) + 1):  # +1: the first round warms up
            for name in ("ulfm", "gloo"):
                dist.barrier(group=gloo)
                start = time.perf_counter()
                if name == "ulfm":
                    assert not ulfm.allreduce(t).wait().has_failure
                else:
                    dist.all_reduce(t, group=gloo)
                if rep:
                    times[name].append(time.perf_counter() - start)
        # Every rank's time counts: the slowest rank decides when the reduce is done.
        med = torch.tensor([statistics.median(times["ulfm"]), statistics.median(times["gloo"])],
                           dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX, group=gloo)
        rows.append({"ranks": ctx.world_size, "size_mib": size_mib,
                     "ulfm_ms": med[0].item() * 1e3, "gloo_ms": med[1].item() * 1e3,
                     "ratio_ulfm_over_gloo": med[0].item() / med[1].item()})
    if ctx.rank == 0:
        out.write_text(json.dumps(rows))
    runtime.finish()


def worker_dtypes(out: Path, scale: float) -> None:
    import torch
    import torch.distributed as dist

    from megatron_recover import runtime

    ctx, ulfm, gloo = groups()
    rows = []
    for size_mib in DTYPE_SIZES_MIB:
        generator = torch.Generator().manual_seed(ctx.rank)
        tensors = {name: torch.randn(size_mib * MIB // torch.tensor([], dtype=dtype).element_size(),
                                     generator=generator).to(dtype)
                   for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                                       ("fp32_staged", torch.float32))}
        times = {name: [] for name in tensors}
        for rep in range(max(3, int(4 * scale)) + 1):  # +1: the first round warms up
            for name, t in tensors.items():
                # fp32_staged: through the host buffer pool, the path of a CUDA tensor.
                ulfm.set_stage_host(name == "fp32_staged")
                dist.barrier(group=gloo)
                start = time.perf_counter()
                assert not ulfm.allreduce(t).wait().has_failure
                if rep:
                    times[name].append(time.perf_counter() - start)
                t.mul_(0.5)  # keep the values' scale: the sum of 2 ranks, halved
        med = torch.tensor([statistics.median(times[name]) for name in tensors],
                           dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX, group=gloo)
        gbps = {name: size_mib * MIB / med[i].item() / 1e9 for i, name in enumerate(tensors)}
        rows.append({"ranks": ctx.world_size, "size_mib": size_mib,
                     "fp32_ms": med[0].item() * 1e3, "bf16_ms": med[1].item() * 1e3,
                     "fp32_gbps": gbps["fp32"], "bf16_gbps": gbps["bf16"],
                     "bf16_over_fp32_gbps": gbps["bf16"] / gbps["fp32"],
                     "fp32_staged_gbps": gbps["fp32_staged"],
                     "staged_over_fp32_gbps": gbps["fp32_staged"] / gbps["fp32"]})
    if ctx.rank == 0:
        out.write_text(json.dumps(rows))
    runtime.finish()


def torch_plane(control, ctx):
    """A torch data plane (gloo) over the ulfm group `control`, as --recover builds it."""
    from megatron_recover import collective

    return collective.TorchPlaneGroup(control, collective.PlaneOptions(
        device="cpu", address="127.0.0.1", stable_rank=ctx.rank, stable_size=ctx.world_size,
        timeout_s=600.0, reconfigure_timeout_s=60.0))


def worker_planes(out: Path, scale: float) -> None:
    """The mpi data plane (a ulfm group) against the torch data plane (gloo reconfigurable,
    over a second ulfm group as its control plane), fp32 and bf16, alternating."""
    import torch
    import torch.distributed as dist

    from megatron_recover import collective, runtime

    ctx, mpi_plane, gloo = groups()
    control = collective.new_group(list(range(ctx.world_size)))
    planes = {"mpi": mpi_plane, "torch": torch_plane(control, ctx)}
    rows = []
    for size_mib in PLANE_SIZES_MIB:
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            numel = size_mib * MIB // torch.tensor([], dtype=dtype).element_size()
            t = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank)).to(dtype)
            times = {name: [] for name in planes}
            for rep in range(max(3, int(PLANE_REPS[size_mib] * scale)) + 1):  # +1: warm-up
                for name, plane in planes.items():
                    dist.barrier(group=gloo)
                    start = time.perf_counter()
                    assert not plane.allreduce(t).wait().has_failure
                    if rep:
                        times[name].append(time.perf_counter() - start)
                    t.mul_(0.5)  # keep the values' scale: the sum of 2 ranks, halved
            med = torch.tensor([statistics.median(times[name]) for name in planes],
                               dtype=torch.float64)
            dist.all_reduce(med, op=dist.ReduceOp.MAX, group=gloo)
            gbps = {name: size_mib * MIB / med[i].item() / 1e9 for i, name in enumerate(planes)}
            rows.append({"ranks": ctx.world_size, "size_mib": size_mib, "dtype": dtype_name,
                         "mpi_ms": med[0].item() * 1e3, "torch_ms": med[1].item() * 1e3,
                         "mpi_gbps": gbps["mpi"], "torch_gbps": gbps["torch"],
                         "torch_over_mpi_gbps": gbps["torch"] / gbps["mpi"]})
    if ctx.rank == 0:
        out.write_text(json.dumps(rows))
    runtime.finish()


def worker_repair(out: Path, plane: str = "mpi") -> None:
    """One rank SIGKILLs itself after a barrier; each survivor's all-reduce, then a consensus
    (which rebuilds the torch plane): the times each returned."""
    import torch

    from megatron_recover import collective, runtime
    from megatron_recover.faults import write_marker

    ctx = runtime.init_distributed()
    group = collective.new_group(list(range(ctx.world_size)))
    group.set_agree_each_op(True)
    if plane == "torch":
        group = torch_plane(group, ctx)
    runtime.track_group(group)
    t = torch.ones(256)
    for _ in range(3):
        group.allreduce(t).wait()
    group.barrier().wait()
    victim = ctx.world_size - 1
    if ctx.rank == victim:
        write_marker(out.with_suffix(".marker"), "before", ctx.rank)
        os.kill(os.getpid(), 9)
    record = group.allreduce(t).wait()
    failed_at = time.time()
    agreed = group.consensus([1]).wait()
    done = time.time()
    again = torch.ones(256)
    exact = (not group.allreduce(again).wait().has_failure
             and bool(torch.all(again == ctx.world_size - 1)))
    (out.parent / f"{out.name}.{ctx.rank}").write_text(json.dumps({
        "failed_at": failed_at, "done": done, "failed": record.has_failure,
        "agreed_failed": list(agreed.failed_ranks), "size": agreed.size, "exact": exact}))
    runtime.finish()


def launch_worker(mode: str, num_ranks: int, out: Path, scale: float, timeout_s: float):
    from megatron_recover.launch import LaunchConfig, launch

    cfg = LaunchConfig(num_ranks, [sys.executable, os.path.abspath(__file__), "--worker", mode,
                                   "--out", str(out), "--reps-scale", str(scale)],
                       out.parent / f"status-{mode}-{num_ranks}", timeout_s)
    result = launch(cfg)
    if result.timed_out:
        raise SystemExit(f"{mode} benchmark at {num_ranks} ranks timed out\n{result.output[-2000:]}")
    return result


def repair_row(num_ranks: int, tmp: Path, plane: str = "mpi") -> dict:
    """Kill to repaired, worst survivor: to its failed all-reduce's return (on the mpi plane
    the group is repaired inside it), and to the consensus after it (on the torch plane the
    data group is rebuilt there); the next all-reduce over the survivors is exact."""
    out = tmp / f"repair-{plane}-{num_ranks}"
    launch_worker(f"repair-{plane}", num_ranks, out, 1.0, 300)
    marker = json.loads(out.with_suffix(".marker").read_text().splitlines()[0])
    survivors = [json.loads(p.read_text()) for p in tmp.glob(f"{out.name}.*")
                 if not p.name.endswith(".marker")]
    assert len(survivors) == num_ranks - 1, f"{num_ranks} ranks: {len(survivors)} survivors wrote"
    assert all(s["failed"] and s["agreed_failed"] in ([num_ranks - 1], []) and s["exact"]
               for s in survivors), survivors
    return {"ranks": num_ranks, "plane": plane,
            "kill_to_failed_op_ms": (max(s["failed_at"] for s in survivors) - marker["time"]) * 1e3,
            "kill_to_repaired_ms": (max(s["done"] for s in survivors) - marker["time"]) * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--reps-scale", type=float, default=1.0, help="scale repetition counts")
    parser.add_argument("--worker", choices=["bandwidth", "dtypes", "planes", "repair-mpi",
                                             "repair-torch"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "bandwidth":
        return worker_bandwidth(args.out, args.reps_scale)
    if args.worker == "dtypes":
        return worker_dtypes(args.out, args.reps_scale)
    if args.worker == "planes":
        return worker_planes(args.out, args.reps_scale)
    if args.worker in ("repair-mpi", "repair-torch"):
        return worker_repair(args.out, args.worker.split("-")[1])

    with tempfile.TemporaryDirectory(prefix="bench-collective-") as tmp:
        tmp = Path(tmp)
        allreduce_rows = []
        for n in BANDWIDTH_RANKS:
            out = tmp / f"bandwidth-{n}.json"
            launch_worker("bandwidth", n, out, args.reps_scale, 900)
            allreduce_rows += json.loads(out.read_text())
            if not args.json:
                print(f"  measured all-reduce at {n} ranks", file=sys.stderr)
        out = tmp / "dtypes.json"
        launch_worker("dtypes", DTYPE_RANKS, out, args.reps_scale, 900)
        dtype_rows = json.loads(out.read_text())
        repair_rows = [repair_row(n, tmp) for n in REPAIR_RANKS]
        out = tmp / "planes.json"
        launch_worker("planes", PLANE_RANKS, out, args.reps_scale, 900)
        plane_rows = json.loads(out.read_text())
        # The mpi plane's rows are `repair_rows` (the same worker): the torch plane's beside.
        plane_repair_rows = [repair_row(n, tmp, "torch") for n in REPAIR_RANKS]
    report = {"machine_cores": os.cpu_count(), "allreduce": allreduce_rows,
              "allreduce_dtypes": dtype_rows, "repair": repair_rows,
              "data_planes": plane_rows, "data_plane_repair": plane_repair_rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"all-reduce, median per call (slowest rank), {os.cpu_count()} cores, oversubscribed:")
    print(f"{'ranks':>5} {'MiB':>5} {'ulfm ms':>10} {'gloo ms':>10} {'ulfm/gloo':>10}")
    for r in allreduce_rows:
        print(f"{r['ranks']:>5} {r['size_mib']:>5} {r['ulfm_ms']:>10.2f} {r['gloo_ms']:>10.2f} "
              f"{r['ratio_ulfm_over_gloo']:>10.2f}")
    print(f"ulfm all-reduce, {DTYPE_RANKS} ranks, fp32 against bf16 of the same bytes:")
    for r in dtype_rows:
        print(f"{r['size_mib']:>5} MiB  fp32 {r['fp32_gbps']:.2f} GB/s  bf16 {r['bf16_gbps']:.2f} "
              f"GB/s  (bf16/fp32 {r['bf16_over_fp32_gbps']:.2f})  fp32 staged "
              f"{r['fp32_staged_gbps']:.2f} GB/s (staged/in place {r['staged_over_fp32_gbps']:.2f})")
    print("kill -> failed operation -> repaired by the consensus after it (worst survivor):")
    for r in [*repair_rows, *plane_repair_rows]:
        print(f"{r['ranks']:>5} ranks {r['plane']:>5}  {r['kill_to_failed_op_ms']:>8.1f} ms  "
              f"{r['kill_to_repaired_ms']:>8.1f} ms")
    print(f"data planes, {PLANE_RANKS} ranks: the mpi plane (ulfm) against the torch plane (gloo):")
    for r in plane_rows:
        print(f"{r['size_mib']:>5} MiB {r['dtype']}  mpi {r['mpi_gbps']:.2f} GB/s  torch "
              f"{r['torch_gbps']:.2f} GB/s  (torch/mpi {r['torch_over_mpi_gbps']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
