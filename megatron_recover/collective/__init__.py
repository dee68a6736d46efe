"""Layer 1: fault-tolerant collectives on the `ulfm` torch.distributed backend."""

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
]
