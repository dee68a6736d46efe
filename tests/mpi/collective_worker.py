"""One rank of a ulfm collective scenario, run under mpirun by tests/test_collective_faults.py.

Usage (mpirun --with-ft ulfm -np N python collective_worker.py SCENARIO OUT_DIR MARKER [FAULT...]).
Each rank writes OUT_DIR/result-RANK.json with every operation's record, the final consensus
record and the verification all-reduce, so the test judges the run from what survivors wrote.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_recover import collective, runtime
from megatron_recover.faults import Fault, FaultInjector

MIB = 1 << 20


def record_dict(op: str, record) -> dict:
    return {"op": op, "failed": record.has_failure, "failed_ranks": list(record.failed_ranks),
            "epoch": record.epoch, "size": record.size, "repaired": record.repaired,
            "census": list(record.census), "broken": record.broken}


def verify(group, rank) -> dict:
    """All-reduce (world rank + 1) over the live members: the exact sum is known."""
    t = torch.full((1024,), float(rank + 1))
    record = group.allreduce(t).wait()
    expected = float(sum(r + 1 for r in group.members))
    return {"record": record_dict("verify", record), "value": t[0].item(),
            "expected": expected, "exact": bool(torch.all(t == expected))}


def kind_of(scenario: str) -> str:
    return scenario_ops(scenario)[0]


def scenario_ops(scenario: str) -> tuple[str, int]:
    """(kind of the operation that is hit, payload elements)."""
    return {
        "allreduce": ("allreduce", 256),
        "staged-allreduce": ("allreduce", 256),
        "consensus": ("consensus", 0),
        "allreduce64m": ("allreduce", 64 * MIB // 4),
        "disjoint": ("allreduce", 256),
        "torch-allreduce": ("torch", 256),
        "broadcast-chunks": ("broadcast", CHUNKED_BYTES),
        "allgather-chunks": ("allgather", CHUNKED_BYTES),
    }[scenario]


# Chunked transfers: CHUNKED_BYTES in chunks of CHUNK_BYTES (the 1 GiB default lowered), so a
# victim can die between chunks of one operation.
CHUNK_BYTES = 64 * 1024
CHUNKED_BYTES = 1 * MIB + 13


def pattern(numel: int, seed: int) -> torch.Tensor:
    """Bytes no two members or offsets share by accident: (index + 7 seed) mod 251."""
    return ((torch.arange(numel, dtype=torch.int64) + 7 * seed) % 251).to(torch.uint8)


def transfer(group, kind: str, rank: int, numel: int) -> tuple[object, bool]:
    """One chunked broadcast (from the lowest live member) or all-gather; (record, exact)."""
    if kind == "broadcast":
        root = min(group.members)
        data = pattern(numel, root) if rank == root else torch.zeros(numel, dtype=torch.uint8)
        record = group.broadcast(data, root).wait()
        return record, torch.equal(data, pattern(numel, root))
    out = torch.zeros(group.size * numel, dtype=torch.uint8)
    record = group.allgather(out, pattern(numel, rank)).wait()
    expected = torch.cat([pattern(numel, member) for member in group.members])
    return record, torch.equal(out, expected)


def main() -> None:
    scenario, out_dir, marker = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    options = [spec for spec in sys.argv[4:] if spec.startswith("--")]
    faults = [Fault.parse(spec) for spec in sys.argv[4:] if spec not in options]
    uniform = "--fast" not in options
    torch_plane = "--torch-plane" in options
    ctx = runtime.init_distributed(status_dir=out_dir / "status")
    rank, world = ctx.rank, ctx.world_size
    if scenario == "disjoint":
        half = world // 2
        members = list(range(half)) if rank < half else list(range(half, world))
        # Both groups are created by all ranks in the same order (torch requires it).
        groups = [collective.new_group(list(range(half))), collective.new_group(list(range(half, world)))]
        group = groups[0] if rank < half else groups[1]
    else:
        members = list(range(world))
        group = collective.new_group(members)
    if torch_plane:  # the control plane is the ulfm group; data operations run on gloo
        group = collective.TorchPlaneGroup(group, collective.PlaneOptions(
            device="cpu", address="127.0.0.1", stable_rank=rank, stable_size=world,
            timeout_s=60.0, reconfigure_timeout_s=30.0))
    group.set_agree_each_op(uniform)
    if scenario.startswith("staged-"):
        group.set_stage_host(True)  # the path of CUDA tensors, with host tensors
    if kind_of(scenario) in ("broadcast", "allgather"):
        group.set_max_chunk_bytes(CHUNK_BYTES)
    runtime.track_group(group)
    injector = FaultInjector(faults, rank, marker)

    kind, numel = scenario_ops(scenario)
    ops = []
    warm = torch.ones(max(numel, 1))
    ops.append(record_dict("warmup", group.allreduce(warm).wait()))
    injector.arm(group)
    injector.before()
    if kind == "allreduce":
        hit = torch.full((numel,), float(rank + 1))
        ops.append(record_dict("hit", group.allreduce(hit).wait()))
        # A staged tensor is written back only on success: a failed one is as it was.
        ops[-1]["untouched"] = bool(torch.all(hit == rank + 1))
    elif kind in ("broadcast", "allgather"):
        ops.append(record_dict("hit", transfer(group, kind, rank, numel)[0]))
    elif kind == "torch":
        # A stock caller: torch.distributed on the group fails stop, the group is repaired.
        hit = torch.full((numel,), float(rank + 1))
        try:
            dist.all_reduce(hit, group=group.process_group)
            raised = ""
        except dist.DistBackendError as error:
            raised = str(error)
        ops.append({"op": "hit", "raised": raised, "epoch": group.epoch, "size": group.size})
    else:
        ops.append(record_dict("hit", group.consensus([1, rank]).wait()))
    agreed = group.consensus([1, rank]).wait()
    result = {
        "rank": rank, "members": members, "ops": ops,
        "consensus": record_dict("consensus", agreed),
        "verify": verify(group, rank),
        "epoch": group.epoch,
    }
    if kind in ("broadcast", "allgather"):  # the same transfer again, over the survivors
        again, exact = transfer(group, kind, rank, numel)
        result["verify_transfer"] = {"record": record_dict("verify_transfer", again),
                                     "exact": exact}
    if scenario == "allreduce64m":
        big = torch.full((numel,), float(rank + 1))
        big_record = group.allreduce(big).wait()
        expected = float(sum(r + 1 for r in group.members))
        result["verify64m"] = {"record": record_dict("verify64m", big_record),
                               "exact": bool(torch.all(big == expected))}
    tmp = out_dir / f"result-{rank}.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out_dir / f"result-{rank}.json")
    runtime.finish()


if __name__ == "__main__":
    main()
