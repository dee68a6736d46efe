"""One rank of part (a) of scripts/gpu_check.sh: the ulfm all-reduce of a CUDA tensor, one rank
killed inside it.

Usage (under mpirun --with-ft ulfm, from scripts/gpu_check.py):
    allreduce_worker.py OUT_DIR MARKER SIZE_MIB WAIT_S [--emulate] FAULT...

FAULT: megatron_recover.faults spec strings ("2:reduce" kills rank 2 inside its next ulfm
all-reduce, "1:delay-reduce@0.3" holds rank 1 back before it, so the operation cannot complete
anywhere before the kill). Each rank binds device local_rank % device_count (the ulfm backend is
MPI, not NCCL: ranks may share a GPU), then:

1. a failure-free all-reduce of SIZE_MIB MiB of float32 over every rank (the warm-up);
2. the faults armed, the same all-reduce again: the victim dies inside it;
3. a consensus (the agreed survivors), then the all-reduce once more from the same inputs over
   the survivors (what the recovery layer does after a failed reduction);
4. reported, not judged: the survivors' all-reduce of the same number of bytes in float32 and
   in bfloat16, and a device-to-host plus host-to-device copy of those bytes through page-locked
   memory (the ceiling of the backend's host staging), each the best of 3, in GB/s;
5. where every rank has a GPU of its own: the same sum on the torch data plane (an NCCL group,
   `ProcessGroupNCCL2`, reconfigured over the survivors; docs/data-planes.md), judged exact, and
   its float32 and bfloat16 GB/s, reported beside step 4's.

Rank r's input is element i = (r + 1) + 16 * (i mod 1024), so the sum over any set S of ranks is
sum_{r in S} (r + 1) + 16 |S| (i mod 1024): integers below 2^24, exact in float32 in any order,
and a lost, doubled or misplaced contribution or chunk changes it. Each rank compares its result
with that closed form computed on its own device and writes OUT_DIR/result-RANK.json (each
step's failure record, exactness, a SHA-256 of the result's bytes for the cross-rank bitwise
comparison, timings); the victim writes only the marker the fault injector leaves.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

MIB = 1 << 20
PERIOD = 1024
STRIDE = 16.0


def record_dict(record) -> dict:
    return {"failed": record.has_failure, "failed_ranks": list(record.failed_ranks),
            "epoch": record.epoch, "size": record.size, "repaired": record.repaired,
            "census": list(record.census)}


def pattern(numel: int, device: str) -> torch.Tensor:
    """16 * (i mod 1024), float32, on `device`."""
    return (torch.arange(numel, dtype=torch.int32, device=device) % PERIOD).to(
        torch.float32) * STRIDE


def expected_sum(base: torch.Tensor, ranks: list[int]) -> torch.Tensor:
    """The closed-form sum of the inputs of `ranks` (see the module docstring)."""
    return base * float(len(ranks)) + float(sum(r + 1 for r in ranks))


def digest(t: torch.Tensor) -> str:
    host = t.detach().contiguous().cpu()
    return hashlib.sha256(host.numpy().data).hexdigest()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_allreduce(group, t: torch.Tensor, wait_s: float) -> tuple[dict, float, float]:
    """(record, seconds from posting to the record, time.time() of the record's return)."""
    synchronize()
    start = time.perf_counter()
    record = group.allreduce(t).wait(wait_s)
    synchronize()
    return record_dict(record), time.perf_counter() - start, time.time()


def best_seconds(step, reps: int = 3) -> float:
    """The fastest of `reps` runs of `step()`, each timed to its device's completion."""
    times = []
    for _ in range(reps):
        synchronize()
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def bandwidth(group, inputs: torch.Tensor, wait_s: float) -> dict:
    """Step 4: GB/s of the buffer's bytes (see the module docstring)."""
    nbytes = inputs.numel() * inputs.element_size()
    as_bf16 = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=inputs.device)
    host = torch.empty(inputs.numel(), dtype=inputs.dtype,
                       pin_memory=torch.cuda.is_available())
    device_copy = inputs.clone()

    def staging():
        host.copy_(device_copy, non_blocking=True)
        device_copy.copy_(host, non_blocking=True)

    figures = {}
    for name, step in (
            ("fp32_allreduce", lambda: group.allreduce(inputs.clone()).wait(wait_s)),
            ("bf16_allreduce", lambda: group.allreduce(as_bf16).wait(wait_s)),
            ("staging_copy", staging)):
        figures[f"{name}_gbps"] = round(nbytes / best_seconds(step) / 1e9, 3)
    return figures


def nccl_plane(group, ctx, base: torch.Tensor, inputs: torch.Tensor, survivors: list[int],
               wait_s: float) -> dict:
    """Step 5 (see main): a second ulfm group over the survivors as the control plane."""
    from megatron_recover import collective

    control = collective.new_group(survivors, parent=group)
    plane = collective.TorchPlaneGroup(control, collective.PlaneOptions(
        device="cuda", address="127.0.0.1", stable_rank=ctx.rank, stable_size=ctx.world_size,
        timeout_s=wait_s, reconfigure_timeout_s=wait_s))
    t = inputs.clone()
    record, seconds, _ = timed_allreduce(plane, t, wait_s)
    return {"record": record, "seconds": seconds, "backend": plane.backend,
            **compare(t, expected_sum(base, survivors)),
            "bandwidth": bandwidth(plane, inputs, wait_s)}


def compare(t: torch.Tensor, expected: torch.Tensor) -> dict:
    mismatched = int((t != expected).sum().item())
    return {"exact": mismatched == 0, "mismatched_elements": mismatched, "digest": digest(t)}


def main() -> None:
    out_dir, marker = Path(sys.argv[1]), Path(sys.argv[2])
    size_mib, wait_s = int(sys.argv[3]), float(sys.argv[4])
    rest = sys.argv[5:]
    emulate = "--emulate" in rest
    specs = [s for s in rest if s != "--emulate"]

    from megatron_recover import collective, runtime
    from megatron_recover.faults import Fault, FaultInjector

    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    if not torch.cuda.is_available():
        if not emulate:
            raise SystemExit("allreduce_worker: no CUDA device (and not --emulate)")
        from megatron_recover.testing import enable_cpu_emulation

        enable_cpu_emulation(device_count=1)  # "cuda" tensors are host tensors
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    device = f"cuda:{torch.cuda.current_device()}"

    ctx = runtime.init_distributed(status_dir=out_dir / "status")
    rank, world = ctx.rank, ctx.world_size
    members = list(range(world))
    group = collective.new_group(members)
    group.set_agree_each_op(True)  # one failure verdict for every survivor
    runtime.track_group(group)

    numel = size_mib * MIB // 4
    base = pattern(numel, device)
    inputs = base + float(rank + 1)
    result = {"rank": rank, "local_rank": local_rank, "device": device,
              "tensor_device": str(inputs.device), "emulated": emulate,
              "gpu": torch.cuda.get_device_name(torch.cuda.current_device())
              if not emulate else "cpu-emulation", "numel": numel}

    # 1. Failure-free, every rank.
    t = inputs.clone()
    record, seconds, _ = timed_allreduce(group, t, wait_s)
    result["warmup"] = {"record": record, "seconds": seconds,
                        **compare(t, expected_sum(base, members))}
    del t

    # 2. The faults armed: the victim dies inside this all-reduce.
    injector = FaultInjector([Fault.parse(s) for s in specs], rank, marker)
    injector.arm(group)
    injector.before()
    hit = inputs.clone()
    record, seconds, returned = timed_allreduce(group, hit, wait_s)
    # The staging path writes a CUDA tensor back only when the operation succeeded.
    result["hit"] = {"record": record, "seconds": seconds, "returned_at": returned,
                     "untouched": bool(torch.equal(hit, inputs))}
    del hit

    # 3. The agreed survivors, then the same reduction over them.
    agreed = group.consensus([1, rank]).wait(wait_s)
    result["consensus"] = record_dict(agreed)
    survivors = group.members
    t = inputs.clone()
    record, seconds, _ = timed_allreduce(group, t, wait_s)
    result["redo"] = {"record": record, "seconds": seconds, "survivors": survivors,
                      **compare(t, expected_sum(base, survivors))}
    del t

    # 4. Bandwidth over the survivors (every survivor runs the same operations).
    result["bandwidth"] = bandwidth(group, inputs, wait_s)
    result["epoch"] = group.epoch

    # 5. The torch data plane: an NCCL group reconfigured over the survivors, where each has a
    # GPU of its own (NCCL refuses two ranks of one group on a device); its sum, and its GB/s
    # beside step 4's host-staged figures.
    if not emulate and torch.cuda.device_count() >= world:
        result["nccl_plane"] = nccl_plane(group, ctx, base, inputs, survivors, wait_s)

    tmp = out_dir / f"result-{rank}.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out_dir / f"result-{rank}.json")
    runtime.finish()


if __name__ == "__main__":
    main()
