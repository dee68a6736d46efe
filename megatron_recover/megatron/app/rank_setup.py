"""What one rank built (`RankSetup`): run.py builds it; the loop, its steppers, the resume and
the progress output read it. Its own module so that none of them imports run.py."""

from dataclasses import dataclass

import torch.distributed as dist

from megatron_recover import collective
from megatron_recover.megatron.persistence.torch_dist import ReplicaWriters


_save_groups = {}  # (ranks, members' key) -> the ulfm group over them that saves


def _save_group(parent: collective.ULFMGroup, ranks: tuple[int, ...],
                key: tuple) -> collective.ULFMGroup:
    """The ulfm group over the torch ranks `ranks`, split from `parent` (repaired: its members
    are the live ranks) by every live rank at once, each for its own group; made once per
    `key` (the live ranks, and which group of them), which every live rank holds alike."""
    group = _save_groups.get(key)
    if group is None or group.epoch > 0:
        group = _save_groups[key] = collective.new_group(list(ranks), parent=parent)
    return group


@dataclass(frozen=True)
class RankSetup:
    """What one rank built: megatron's model and optimizer, and its place among the replicas."""

    chunks: tuple  # megatron's DDP over each model chunk: one, or one per virtual stage
    optimizer: object
    scheduler: object
    group: collective.ULFMGroup | None  # the cross-replica group of this position (ulfm)
    replica_of_rank: dict[int, int] | None  # world rank -> replica index (its rank in `group`)
    replica_group: object  # this replica's ranks: TP x PP (x its shards, with instances)
    control_group: object | None  # gloo mirror of `replica_group` (groups.py); None: one rank
    shard_group: object | None  # distributed-optimizer instances: the replica's DP ranks here
    shard_control_group: object | None  # gloo mirror of `shard_group`
    saving_group: collective.ULFMGroup | None  # --recover torch_dist saves: every training rank
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

    def checkpoint_writers(self, replica: int, lowest: int) -> ReplicaWriters | None:
        """Who writes a torch_dist checkpoint now, seen from this rank of replica `replica`
        (`lowest`: the lowest live replica): every live rank, replicated tensors spread over
        the live replicas; or, when a standby joined (it has a torch world of its own), the
        lowest live replica alone, and None on the other ranks. Collective over every live
        rank: `saving_group`, made at start-up over every training rank, is repaired by a
        consensus (its members are then the live ranks), and the savers' group and this
        position's group are split from it."""
        shard = 0 if self.shard_group is None else dist.get_rank(self.shard_group)
        shards = 1 if self.shard_group is None else dist.get_world_size(self.shard_group)
        offset = self.dp_rank - shard
        experts = _expert_parallel_size()
        if self.spreads_saves():
            parent = self.saving_group
            for _ in range(3):  # a failure found repairs it; one more shows it whole
                if not parent.consensus().wait().has_failure:
                    break
            live = tuple(sorted(parent.members))
            savers = _save_group(parent, live, (live,))
            positions = [None] * len(live)
            dist.all_gather_object(positions, self.checkpoint_position,
                                   group=savers.process_group)
            mine = tuple(r for r, p in zip(live, positions) if p == self.checkpoint_position)
            spread = _save_group(parent, mine, (live, self.checkpoint_position))
            return ReplicaWriters(savers.process_group, offset, distance=replica - lowest,
                                  shards=shards, experts=experts, spread=spread.process_group,
                                  agree=savers.process_group)
        if replica != lowest:
            return None
        return ReplicaWriters(self.replica_group, offset, shards=shards, experts=experts,
                              agree=self.control_group)

    def spreads_saves(self) -> bool:
        """Whether every live rank saves (`checkpoint_writers`): not when a standby joined (a
        replica joins as a whole, so a standby's rank is at every position)."""
        return (self.saving_group is not None and collective.world_ranks([0]) == [0]
                and max(self.group.members) < dist.get_world_size())

    @property
    def padded_vocab_size(self) -> int:
        """The model's vocabulary, padded as megatron pads it (its embedding's rows over all
        tensor-parallel ranks)."""
        return self.unwrapped_chunks()[0].vocab_size

    def unwrapped_model(self):
        """The GPTModel inside megatron's DDP wrapper (and Float16Module, in fp16/bf16); with
        virtual pipeline stages a ModuleList of each chunk's (its parameters named "0.", "1.",
        ... by chunk)."""
        import torch

        chunks = self.unwrapped_chunks()
        return chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)

    def unwrapped_chunks(self) -> list:
        """Each model chunk's GPTModel (`unwrapped_model`)."""
        return [unwrap(chunk) for chunk in self.chunks]


def _expert_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def unwrap(ddp_model):
    """The GPTModel inside megatron's DDP wrapper (and Float16Module, in fp16/bf16)."""
    from megatron.core.transformer.module import Float16Module

    model = ddp_model.module
    return model.module if isinstance(model, Float16Module) else model
