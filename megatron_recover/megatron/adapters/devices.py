"""Where a rank trains: its device, bound by the node-local rank as Megatron-LM's `initialize`
binds it, and the batches it feeds the model moved there as Megatron-LM's `get_batch` moves them.

The code here is the same on a GPU and under the CPU emulation (megatron_recover.testing): the
emulation's devices are the host, but it records which tensors were placed on one, so a CPU test
fails when a move below is missing (tests/unit/test_device_discipline.py).
"""

import re
from dataclasses import dataclass

import torch

# Where launchers put the node-local rank, in the order they are trusted: Open MPI's own (set by
# its daemon on every node, also when mpirun runs inside a Slurm allocation, where SLURM_LOCALID
# would be the daemon's task, 0 on every rank), MPICH's, Slurm's direct launch, torchrun's.
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                        "LOCAL_RANK")
LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE",
                        "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class NodePlace:
    """This rank's place on its node: `local_rank` of `local_size` ranks started there."""

    local_rank: int
    local_size: int

    @classmethod
    def from_environment(cls, environ) -> "NodePlace":
        """The launcher's node-local rank and size (`environ`: a mapping such as os.environ);
        a process started alone is rank 0 of 1."""
        def first(names, default):
            for name in names:
                value = environ.get(name, "").strip()
                if value:
                    number = re.match(r"\d+", value)  # SLURM_NTASKS_PER_NODE may read "4(x2)"
                    if number is None:
                        raise ValueError(f"{name}={value!r} is not a node-local rank or size")
                    return int(number.group())
            return default
        local_rank = first(LOCAL_RANK_VARIABLES, 0)
        return cls(local_rank, max(first(LOCAL_SIZE_VARIABLES, 1), local_rank + 1))


def device_index(place: NodePlace, ranks_per_device: int) -> int:
    """The CUDA device of the rank at `place`: one rank per device (Megatron-LM's binding,
    `local_rank`), or `ranks_per_device` consecutive local ranks sharing one
    (--recover-ranks-per-device, for tests of several replicas on one GPU)."""
    return place.local_rank // ranks_per_device


def devices_needed(place: NodePlace, ranks_per_device: int) -> int:
    """How many devices the node's ranks are bound to."""
    return -(-place.local_size // ranks_per_device)


def bind(place: NodePlace, ranks_per_device: int) -> int:
    """`torch.cuda.set_device` for this rank (before any CUDA tensor or NCCL group exists).
    Raises ValueError, saying what to change, when the node has fewer devices than its ranks
    need. Returns the device index."""
    index = device_index(place, ranks_per_device)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"local rank {place.local_rank} of {place.local_size} on this node needs CUDA device "
            f"{index}, and the node has {count}: start one rank per GPU (mpirun --map-by "
            f"ppr:{count}:node), or let ranks share a device with --recover-ranks-per-device "
            f"(replicas of one rank each only: NCCL refuses two ranks of one group on a device)")
    torch.cuda.set_device(index)
    return index


def describe() -> str:
    """The rank's device for its status file: "cuda:N", or "cuda:N (CPU emulation)"."""
    index = torch.cuda.current_device()
    return f"cuda:{index}" if torch.cuda.is_available() else f"cuda:{index} (CPU emulation)"


def batch_to_device(batch: dict) -> dict:
    """`batch` with its tensors on the current device, as Megatron-LM's get_batch moves them:
    asynchronously from page-locked host memory where CUDA is present (the copy overlaps the
    previous microbatch's kernels); other values unchanged."""
    pin = torch.cuda.is_available()

    def moved(value):
        if not isinstance(value, torch.Tensor):
            return value
        return (value.pin_memory() if pin else value).cuda(non_blocking=True)

    return {key: moved(value) for key, value in batch.items()}


def model_to_device(model):
    """Megatron-LM's get_model: the model on the current device before its fp16/bf16 wrapper and
    DDP (megatron-core builds most parameters there already; not its learned position
    embedding or anything built with --use-cpu-initialization)."""
    return model.cuda(torch.cuda.current_device())
