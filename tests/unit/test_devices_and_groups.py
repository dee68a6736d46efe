"""A rank's device and its groups by role (megatron_recover/megatron/adapters/devices.py, groups.py): the
node-local rank from the launcher's variables and the device it binds; on a CUDA plan megatron's
own groups are NCCL and no control collective runs on them; on a CPU plan everything is gloo or
ulfm; the control groups are gloo mirrors, distinct from the training groups they mirror.

Run: .venv/bin/python -m pytest tests/unit/test_devices_and_groups.py (CPU only, seconds).
"""

import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron_recover.megatron.adapters import groups

pytestmark = pytest.mark.unit


def test_on_cuda_the_training_groups_are_nccl_and_no_control_collective_uses_them():
    plan = groups.plan_groups(cuda=True, distributed_backend="nccl",
                              cross_replica_backend="ulfm")
    assert plan.world == "nccl" and plan.backend(groups.TRAINING) == "nccl"
    assert plan.backend(groups.CROSS_REPLICA) == "ulfm"
    control = plan.control_backends()
    # The collectives the GPU-path issue names, each on a group that carries CPU tensors.
    assert {"commit lane", "replica verdict", "exit request", "evaluation sums",
            "join election", "checkpoint barrier"} <= set(control)
    assert not [name for name, backend in control.items() if backend not in ("gloo", "ulfm")]
    assert groups.TRAINING not in groups.CONTROL_COLLECTIVES.values()


def test_on_cpu_everything_is_gloo_or_ulfm():
    for backend in ("nccl", "gloo"):  # the CPU stands gloo in for NCCL
        plan = groups.plan_groups(cuda=False, distributed_backend=backend,
                                  cross_replica_backend="ulfm")
        assert plan.world == "gloo"
        used = {plan.backend(role) for role in (groups.TRAINING, groups.CROSS_REPLICA,
                                                *groups.CONTROL_COLLECTIVES.values())}
        assert used == {"gloo", "ulfm"}


def test_stock_runs_and_megatrons_gloo_choice():
    plan = groups.plan_groups(cuda=True, distributed_backend="gloo", cross_replica_backend="gloo")
    assert plan.backend(groups.TRAINING) == "gloo" and plan.cross_replica == "gloo"
    with pytest.raises(ValueError, match="--distributed-backend mpi: choose one of nccl, gloo"):
        groups.plan_groups(cuda=True, distributed_backend="mpi", cross_replica_backend="ulfm")
    with pytest.raises(ValueError, match="unknown group role"):
        plan.backend("tensor parallel")


def test_a_mirror_is_a_gloo_group_of_the_same_ranks_distinct_from_its_original():
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0,
                                world_size=1)
        try:
            training = dist.new_group([0])
            mirror = groups.mirror_of(training)
            assert mirror is not training
            assert dist.get_backend(mirror) == "gloo"
            assert dist.get_process_group_ranks(mirror) == [0]
            flag = torch.ones(1, dtype=torch.float64)
            dist.all_reduce(flag, group=mirror)
            assert flag.item() == 1.0
            assert groups.world_control() is dist.group.WORLD  # a gloo world is its own
        finally:
            dist.destroy_process_group()


def test_the_node_local_rank_comes_from_the_launcher():
    from megatron_recover.megatron.adapters.devices import NodePlace, device_index, devices_needed

    # Open MPI's own variables win over Slurm's, which under mpirun name the daemon's task.
    place = NodePlace.from_environment({"OMPI_COMM_WORLD_LOCAL_RANK": "3",
                                        "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
                                        "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1"})
    assert place == NodePlace(3, 8) and device_index(place, 1) == 3
    assert device_index(place, 4) == 0 and devices_needed(place, 4) == 2
    assert devices_needed(NodePlace(0, 5), 2) == 3
    slurm = NodePlace.from_environment({"SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)"})
    assert slurm == NodePlace(1, 4)
    assert NodePlace.from_environment({}) == NodePlace(0, 1)
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not a node-local rank"):
        NodePlace.from_environment({"LOCAL_RANK": "x"})


def test_binding_sets_the_device_and_refuses_a_node_short_of_devices():
    from megatron_recover.megatron.adapters.devices import NodePlace, bind
    from megatron_recover.testing import cpu_emulation_enabled

    with cpu_emulation_enabled(device_count=2):
        assert bind(NodePlace(1, 2), 1) == 1 and torch.cuda.current_device() == 1
        assert bind(NodePlace(3, 4), 2) == 1
        with pytest.raises(ValueError, match="local rank 2 of 4 on this node needs CUDA device 2, "
                                             "and the node has 2"):
            bind(NodePlace(2, 4), 1)
