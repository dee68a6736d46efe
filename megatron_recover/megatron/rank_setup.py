"""What one rank built (`RankSetup`): run.py builds it; the loop, its steppers, the resume and
the progress output read it. Its own module so that none of them imports run.py."""

from dataclasses import dataclass

import torch.distributed as dist

from megatron_recover import collective
from megatron_recover.megatron.dist_checkpoint import ReplicaWriters


@dataclass(frozen=True)
class RankSetup:
    """What one rank built: megatron's model and optimizer, and its place among the replicas."""

    ddp_model: object
    optimizer: object
    scheduler: object
    group: collective.ULFMGroup | None  # the cross-replica group of this position (ulfm)
    replica_of_rank: dict[int, int] | None  # world rank -> replica index (its rank in `group`)
    replica_group: object  # this replica's ranks: TP x PP (x its shards, with instances)
    control_group: object | None  # gloo mirror of `replica_group` (groups.py); None: one rank
    shard_group: object | None  # distributed-optimizer instances: the replica's DP ranks here
    shard_control_group: object | None  # gloo mirror of `shard_group`
    dp_rank: int
    replica_index: int  # the data-parallel rank, or the distributed-optimizer instance
    local_rank: int
    position: tuple[int, int]  # (tensor, pipeline) parallel rank

    @property
    def checkpoint_position(self) -> tuple[int, ...]:
        """Which file of a checkpoint is this rank's: its (tensor, pipeline) position and, with
        distributed-optimizer shards, its shard (each holds its own optimizer state)."""
        if self.shard_group is None or dist.get_world_size(self.shard_group) == 1:
            return self.position
        return (*self.position, dist.get_rank(self.shard_group))

    def checkpoint_writers(self):
        """This rank's replica as the writers of a torch_dist checkpoint: its training group,
        and the data-parallel rank of its first rank (a replica's shards are consecutive
        data-parallel ranks)."""
        shard = 0 if self.shard_group is None else dist.get_rank(self.shard_group)
        return ReplicaWriters(self.replica_group, self.dp_rank - shard)

    @property
    def padded_vocab_size(self) -> int:
        """The model's vocabulary, padded as megatron pads it (its embedding's rows over all
        tensor-parallel ranks)."""
        return self.unwrapped_model().vocab_size

    def unwrapped_model(self):
        """The GPTModel inside megatron's DDP wrapper (and Float16Module, in fp16/bf16)."""
        from megatron.core.transformer.module import Float16Module

        model = self.ddp_model.module
        return model.module if isinstance(model, Float16Module) else model
