"""Which torch.distributed backend each role's process groups use (groups by role), and the
control groups that carry a rank's bookkeeping.

Three roles (docs/devices.md):

- *Training*: megatron's tensor-, pipeline- and data-parallel groups and, with
  distributed-optimizer instances, the intra-instance group. They carry the model's tensors on
  the training device: NCCL on GPUs (`--distributed-backend`, Megatron-LM's default), gloo on the
  CPU, where the emulation's device is the host.
- *Cross-replica*: the data-parallel group, or the group between instances, on `ulfm` (layer 1);
  CUDA tensors reach MPI through host staging.
- *Control*: the commit lane (on the cross-replica ulfm group), and the collectives of CPU
  tensors inside a replica or over the job: the replica verdict, a shard's verdict, evaluation
  sums, the checkpoint barrier, the join election, the stock loop's loss sums and exit vote, the
  start-up exchanges (which ranks form a replica, where each rank lives). The writer needs no
  election: it is the lowest live rank of the membership the commit agreed.
  They run on gloo mirrors of the training groups, never on an NCCL group, which cannot carry
  CPU tensors.

On the CPU the same plan is made and the same mirrors built, so the CPU tests run the control
collectives where a GPU job runs them.
"""

from dataclasses import dataclass

TRAINING = "training"
CROSS_REPLICA = "cross-replica"
REPLICA_CONTROL = "replica control"  # gloo mirror of the replica's model-parallel group
SHARD_CONTROL = "shard control"  # gloo mirror of an instance's shard group
WORLD_CONTROL = "world control"  # gloo mirror of the torch world

# Every control collective and the group role it runs on.
CONTROL_COLLECTIVES = {
    "commit lane": CROSS_REPLICA,
    "replica verdict": REPLICA_CONTROL,
    "shard verdict": SHARD_CONTROL,
    "exit request": CROSS_REPLICA,  # it rides the commit lane
    "evaluation sums": CROSS_REPLICA,  # after the shards' sum on SHARD_CONTROL
    "evaluation shard sums": SHARD_CONTROL,
    "checkpoint barrier": REPLICA_CONTROL,
    "join election": REPLICA_CONTROL,
    "stock loss sums": WORLD_CONTROL,
    "stock exit request": WORLD_CONTROL,
    "stock evaluation sums": WORLD_CONTROL,
    "replica layout exchange": WORLD_CONTROL,
    "snapshot placement exchange": WORLD_CONTROL,
}

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class GroupPlan:
    """The backend of each role's groups on this machine."""

    world: str  # torch's default group, which megatron's groups inherit
    cross_replica: str  # "ulfm" (--recover), or the world's for stock runs

    def backend(self, role: str) -> str:
        if role == TRAINING:
            return self.world
        if role == CROSS_REPLICA:
            return self.cross_replica
        if role in (REPLICA_CONTROL, SHARD_CONTROL, WORLD_CONTROL):
            return "gloo"
        raise ValueError(f"unknown group role {role!r}")

    def control_backends(self) -> dict[str, str]:
        """Each control collective's backend."""
        return {name: self.backend(role) for name, role in CONTROL_COLLECTIVES.items()}


def plan_groups(cuda: bool, distributed_backend: str, cross_replica_backend: str) -> GroupPlan:
    """The plan for a job on CUDA (`cuda`) or the CPU. `distributed_backend`: Megatron-LM's
    --distributed-backend, the training groups' backend on CUDA; on the CPU they are gloo (the
    emulation stands the host in for the GPU and gloo for NCCL). `cross_replica_backend`: "ulfm"
    under --recover."""
    if distributed_backend not in BACKENDS:
        raise ValueError(f"--distributed-backend {distributed_backend}: choose one of "
                         f"{', '.join(BACKENDS)}")
    world = distributed_backend if cuda else "gloo"
    return GroupPlan(world=world, cross_replica=cross_replica_backend)


def every_group(members) -> list[tuple[int, ...]]:
    """The distinct groups of one role over the torch world, given this rank's `members`, in
    one order on every rank: the order in which their creation, collective over the world,
    must go. Collective over the world, start-up only."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(members), group=world_control())
    return sorted(set(everyone))


def mirror_of(group):
    """The gloo mirror of `group`, a torch group this rank is in (collective over the world:
    every rank calls it for the same role, start-up only)."""
    import torch.distributed as dist

    members = tuple(dist.get_process_group_ranks(group))
    mine = None
    for ranks in every_group(members):
        mirror = dist.new_group(list(ranks), backend="gloo")
        if ranks == members:
            mine = mirror
    return mine


_world_control = {"group": None}


def world_control():
    """The gloo group over the whole torch world (the default group itself when it is gloo).
    Created on the first call, collective over the world: `run.build` makes it first, on every
    rank, at start-up."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if _world_control["group"] is None:
        _world_control["group"] = dist.new_group(backend="gloo")
    return _world_control["group"]
