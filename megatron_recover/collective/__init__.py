"""Layer 1: fault-tolerant collectives: the `ulfm` torch.distributed backend (the control plane,
and the mpi data plane) and the torch data plane reconfigured over survivors."""

from megatron_recover.collective.backend import (
    DEFAULT_TIMEOUT_S,
    ULFMGroup,
    ULFMWork,
    new_group,
    register,
    require_fault_tolerance,
    set_world_rank_offset,
    world_ranks,
)
from megatron_recover.collective.torch_plane import (
    PlaneOptions,
    TorchPlaneGroup,
    reconfigure_supported,
)
from megatron_recover.collective.records import (
    BackendUnavailable,
    CollectiveTimeout,
    FailureRecord,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "BackendUnavailable", "CollectiveTimeout", "FailureRecord",
    "ULFMGroup", "ULFMWork", "new_group", "register", "require_fault_tolerance",
    "set_world_rank_offset", "world_ranks",
    "PlaneOptions", "TorchPlaneGroup", "reconfigure_supported",
]
