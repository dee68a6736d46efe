"""One rank of the ulfm operations check (no faults), run by tests/test_collective_ops.py.

Usage: mpirun --with-ft ulfm -np N python ops_worker.py CHECK OUT_DIR MARKER
CHECK is `ops` (every operation and dtype, in place and staged) or `no-ft` (expects group creation to refuse).
Writes OUT_DIR/result-RANK.json: check name -> bool, plus details for failed checks.
"""

import json
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_recover import collective, runtime
from megatron_recover.collective import BackendUnavailable, CollectiveTimeout
from megatron_recover.collective.backend import native_module

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
    # gather and scatter (megatron-core's distributed checkpoints plan and finalize with them).
    gathered = [None] * n if rank == n - 1 else None
    dist.gather_object(("r", rank), gathered, dst=n - 1, group=pg)
    checks["torch_gather_object"] = gathered == ([("r", r) for r in range(n)] if rank == n - 1
                                                 else None)
    scattered = [None]
    dist.scatter_object_list(scattered, [f"to{r}" * (r + 1) for r in range(n)] if rank == 0
                             else None, src=0, group=pg)
    checks["torch_scatter_object"] = scattered == [f"to{rank}" * (rank + 1)]
    # Groups split from this one, every member at once, each its own: the even and odd ranks.
    half = [r for r in range(n) if r % 2 == rank % 2]
    split = collective.new_group(half, parent=group)
    ones = torch.ones(3)
    record = split.allreduce(ones).wait()
    checks["split_from_parent"] = (not record.has_failure and split.members == half
                                   and bool(torch.all(ones == len(half))))

    # Transfers larger than one MPI call moves, in chunks (lowered from 1 GiB to 1000 bytes):
    # lengths that do not divide, and an empty one.
    group.set_max_chunk_bytes(1000)
    payload = (torch.arange(10007) % 251).to(torch.uint8)
    b3 = payload.clone() if rank == n - 1 else torch.zeros(10007, dtype=torch.uint8)
    record = group.broadcast(b3, src_world_rank=n - 1).wait()
    checks["broadcast_chunked"] = not record.has_failure and torch.equal(b3, payload)
    checks["broadcast_empty"] = not group.broadcast(torch.empty(0), n - 1).wait().has_failure
    mine = ((torch.arange(2503) + 7 * rank) % 251).to(torch.uint8)
    out = torch.zeros(n * 2503, dtype=torch.uint8)
    record = group.allgather(out, mine).wait()
    expected = torch.cat([((torch.arange(2503) + 7 * r) % 251).to(torch.uint8) for r in range(n)])
    checks["allgather_chunked"] = not record.has_failure and torch.equal(out, expected)
    checks["chunk_bounds"] = "a chunk holds 1 to" in expect_error(
        ValueError, lambda: group.set_max_chunk_bytes(0))
    group.set_max_chunk_bytes(1 << 30)

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


def check_staged(group, rank: int, n: int) -> dict:
    """Every operation again with CPU tensors staged through the group's host buffers, the
    path CUDA tensors take: the same results, and the buffers reused across operations."""
    group.set_stage_host(True)
    before = group.staging_stats()
    checks = {f"staged_{name}": ok for name, ok in check_ops(group, rank, n).items()}
    for _ in range(3):  # a bucket's size, iteration after iteration: one buffer serves them
        t = torch.full((1000,), float(rank + 1))
        group.allreduce(t).wait()
    stats = group.staging_stats()
    group.set_stage_host(False)
    checks["staged_buffers_allocated"] = stats["allocated"] > before["allocated"]
    checks["staged_buffers_reused"] = stats["reused"] >= before["reused"] + 2
    checks["staged_buffers_idle"] = stats["idle"] >= 1 and stats["idle_bytes"] > 0
    checks["direct_refused_without_cuda_mpi"] = (
        native_module().mpi_cuda_aware()
        or "not CUDA-aware" in expect_error(ValueError, lambda: group.set_direct_device(True)))
    return checks


def check_big(group, rank: int, n: int) -> dict:
    """A broadcast and an all-gather of more than 1 GiB at the default chunk size (so they
    cross the 1 GiB boundary of one MPI call), checked byte for byte, with their times."""
    def pattern(numel: int, shift: int) -> torch.Tensor:  # period 251: no chunk repeats it
        period = torch.roll(torch.arange(251, dtype=torch.uint8), shift)
        return period.repeat(numel // 251 + 1)[:numel]

    checks = {}
    numel = (1 << 30) + (1 << 20) + 3
    data = pattern(numel, 0) if rank == 0 else torch.zeros(numel, dtype=torch.uint8)
    start = time.perf_counter()
    record = group.broadcast(data, src_world_rank=0).wait()
    checks["broadcast_seconds"] = time.perf_counter() - start
    checks["broadcast_over_1gib"] = not record.has_failure and torch.equal(data, pattern(numel, 0))
    del data
    part = (1 << 30) // n + 4099  # the gathered total passes 1 GiB
    out = torch.zeros(n * part, dtype=torch.uint8)
    start = time.perf_counter()
    record = group.allgather(out, pattern(part, rank)).wait()
    checks["allgather_seconds"] = time.perf_counter() - start
    checks["allgather_over_1gib"] = not record.has_failure and all(
        torch.equal(out[r * part:(r + 1) * part], pattern(part, r)) for r in range(n))
    return checks


def sample_state() -> dict:
    """A training state's shapes of value, the same on every rank: a module state_dict (an
    OrderedDict with `_metadata`), optimizer state, RNG bytes, 0-dim, empty, bool and bf16
    tensors, one tensor larger than a pack, and plain objects."""
    g = torch.Generator().manual_seed(7)
    model = OrderedDict([("a", torch.randn(1000, generator=g)),
                         ("b", torch.randn(37, 3, generator=g).to(torch.bfloat16)),
                         ("empty", torch.empty(0, 4)), ("step", torch.tensor(5)),
                         ("mask", torch.rand(17, generator=g) > 0.5)])
    model._metadata = OrderedDict([("", {"version": 1})])
    torch.manual_seed(11)
    # The RNG state shares a pack with the model's tensors, after them (not at its start).
    return {"iteration": 3, "model": model, "rng": [torch.get_rng_state()],
            "big": torch.randn(300_000, generator=g),
            "optimizer": {"state": {0: {"exp_avg": torch.randn(2000, generator=g,
                                                               dtype=torch.float64)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "layout": ("majors", (0, 1, 2))}


def same(a, b) -> bool:
    """Equal structure, types and bytes (`_metadata` of a state_dict included)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                b.view(-1).view(torch.uint8) if b.numel() else b))
    if isinstance(a, dict):
        return (type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
                and getattr(a, "_metadata", None) == getattr(b, "_metadata", None))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def check_state(group, rank: int, n: int, marker: Path) -> dict:
    """`broadcast_state` with small packs and chunks; then, with 4 ranks, a join's transfer
    (`standby.transfer`) whose donor dies in the middle of the tensors: the next survivor
    sends, and both joiners hold the state."""
    from megatron_recover.recovery.membership import standby
    from megatron_recover.recovery.membership import transfer

    transfer.PACK_BYTES = 16384  # the RNG state shares a pack, the big tensor goes alone
    group.set_max_chunk_bytes(64 * 1024)  # which crosses chunks
    expected = sample_state()
    checks = {}
    state, ok = transfer.broadcast_state(group, n - 1, expected if rank == n - 1 else None)
    checks["state_received"] = ok and same(state, expected)
    checks["state_is_host_tensors"] = ok and all(t.device.type == "cpu"
                                                 for t in state["model"].values())
    # Readers that take a tensor's storage from its start (torch.set_rng_state) get the right
    # bytes: the next draw is the sender's.
    if ok:
        torch.set_rng_state(state["rng"][0])
        drawn = torch.rand(3)
        torch.set_rng_state(expected["rng"][0])
        checks["rng_state_usable"] = torch.equal(drawn, torch.rand(3))
    state, ok = transfer.broadcast_state(group, n - 1, expected if rank == n - 1 else None,
                                               keep=False)
    checks["state_not_kept"] = ok and (state is None if rank != n - 1 else state is expected)
    if n == 4:
        survivors = rank < 2
        if rank == 0:  # the donor dies entering its 2nd pack, the big tensor (4th broadcast)
            group.arm_fault("broadcast", group.fault_hits("broadcast") + 4, "kill", 0.0,
                            str(marker), {"point": "broadcast"})
        state, alive, lost = standby.transfer(group, {2: 2, 3: 3},
                                              expected if survivors else None)
        checks["transfer_state"] = same(state, expected)
        checks["transfer_lists"] = (alive, lost) == ([2, 3], [0])
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
    if check == "state":
        checks = check_state(group, ctx.rank, ctx.world_size, Path(sys.argv[3]))
    elif check == "big":
        checks = check_big(group, ctx.rank, ctx.world_size)
    else:
        checks = check_ops(group, ctx.rank, ctx.world_size)
        checks.update(check_staged(group, ctx.rank, ctx.world_size))
    write(out_dir, ctx.rank, {"checks": checks})
    runtime.finish()


if __name__ == "__main__":
    main()
