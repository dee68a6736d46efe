"""One rank of the ulfm operations check (no faults), run by tests/test_collective_ops.py.

Usage: mpirun --with-ft ulfm -np N python ops_worker.py CHECK OUT_DIR MARKER
CHECK is `ops` (every operation and dtype) or `no-ft` (expects group creation to refuse).
Writes OUT_DIR/result-RANK.json: check name -> bool, plus details for failed checks.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_recover import collective, runtime
from megatron_recover.collective import BackendUnavailable, CollectiveTimeout

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]


def write(out_dir: Path, rank: int, result: dict) -> None:
    tmp = out_dir / f"result-{rank}.tmp"
    tmp.write_text(json.dumps({"rank": rank, **result}))
    os.replace(tmp, out_dir / f"result-{rank}.json")


def expect_error(kind, fn) -> str:
    try:
        fn()
    except kind as error:
        return str(error)
    return ""


def check_ops(group, rank: int, n: int) -> dict:
    checks = {}
    total = n * (n + 1) // 2
    for dtype in DTYPES:
        t = torch.full((257,), rank + 1, dtype=dtype)
        record = group.allreduce(t).wait()
        checks[f"allreduce_{dtype}"] = not record.has_failure and bool(torch.all(t == total))
    # 16-bit sums round once per pairwise sum (fp32 add, round to nearest even), as torch adds
    # two such tensors: ranks 0 and 1 give random values and the others zeros, so whatever the
    # reduction's order the result is round(x0 + x1), which torch computes independently.
    for dtype in (torch.bfloat16, torch.float16):
        inputs = [torch.randn(4099, generator=torch.Generator().manual_seed(r)).to(dtype)
                  for r in (0, 1)]
        t = inputs[rank].clone() if rank < 2 else torch.zeros(4099, dtype=dtype)
        record = group.allreduce(t).wait()
        expected = inputs[0] + inputs[1] if n > 1 else inputs[0]
        checks[f"allreduce_{dtype}_rounds_once"] = (not record.has_failure
                                                    and torch.equal(t.view(torch.int16),
                                                                    expected.view(torch.int16)))
    strided = torch.full((8, 6), float(rank + 1)).t()
    group.allreduce(strided).wait()
    checks["allreduce_noncontiguous"] = bool(torch.all(strided == total))

    pg = group.process_group
    t = torch.full((5,), float(rank + 1))
    work = dist.all_reduce(t, group=pg, async_op=True)
    work.wait()
    checks["torch_all_reduce"] = bool(torch.all(t == total))
    checks["torch_work_has_record"] = hasattr(work, "record") and not work.has_failure()

    # Megatron's bucket groups reduce through torch's coalescing manager.
    parts = [torch.full((7,), float(rank + 1)), torch.full((3,), rank + 1, dtype=torch.int64)]
    with dist._coalescing_manager(group=pg, async_ops=True) as cm:
        for part in parts:
            dist.all_reduce(part, group=pg)
    cm.wait()
    checks["coalesced_all_reduce"] = all(bool(torch.all(part == total)) for part in parts)

    b = torch.full((3,), float(rank))
    group.broadcast(b, src_world_rank=n - 1).wait()
    checks["broadcast"] = bool(torch.all(b == n - 1))
    b2 = torch.full((3,), float(rank))
    dist.broadcast(b2, src=0, group=pg)
    checks["torch_broadcast"] = bool(torch.all(b2 == 0))

    out = torch.empty(n * 4)
    group.allgather(out, torch.full((4,), float(rank))).wait()
    checks["allgather"] = out.tolist() == [float(r) for r in range(n) for _ in range(4)]
    rows = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(rows, torch.tensor([rank, rank * 10]), group=pg)
    checks["torch_all_gather"] = [r.tolist() for r in rows] == [[r, r * 10] for r in range(n)]

    checks["barrier"] = not group.barrier().wait().has_failure
    dist.barrier(group=pg)
    record = group.consensus([1, rank, 7]).wait()
    checks["consensus_census"] = list(record.census) == [n, n * (n - 1) // 2, 7 * n]
    checks["epoch_zero"] = group.epoch == 0 and record.epoch == 0 and group.size == n

    bad_dtype = expect_error(ValueError, lambda: group.allreduce(torch.zeros(2, dtype=torch.complex64)))
    checks["rejects_complex"] = "ComplexFloat" in bad_dtype
    bad_op = expect_error(ValueError, lambda: dist.all_reduce(torch.zeros(2), op=dist.ReduceOp.MAX,
                                                              group=pg))
    checks["rejects_max"] = "ReduceOp.SUM" in bad_op

    if n >= 2:
        # Rank 1 joins late: rank 0's bounded wait must raise, then the operation still completes.
        if rank == 1:
            time.sleep(1.5)
        t = torch.full((4,), float(rank + 1))
        work = group.allreduce(t)
        if rank == 0:
            message = expect_error(CollectiveTimeout, lambda: work.wait(timeout_s=0.3))
            checks["wait_timeout_raises"] = "did not complete within" in message
        record = work.wait()
        checks["after_timeout_completes"] = not record.has_failure and bool(torch.all(t == total))
    return checks


def main() -> None:
    check, out_dir = sys.argv[1], Path(sys.argv[2])
    ctx = runtime.init_distributed(status_dir=out_dir / "status")
    if check == "no-ft":
        message = expect_error(BackendUnavailable, lambda: collective.new_group([0]))
        write(out_dir, ctx.rank, {"refused": message})
        sys.stdout.flush()
        os._exit(0)
    group = collective.new_group(list(range(ctx.world_size)))
    runtime.track_group(group)
    write(out_dir, ctx.rank, {"checks": check_ops(group, ctx.rank, ctx.world_size)})
    runtime.finish()


if __name__ == "__main__":
    main()
