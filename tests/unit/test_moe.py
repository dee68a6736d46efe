"""Mixture-of-experts pieces that need no MPI: the shards' shares of a pass (padded when the
shards exchange tokens), --moe-layer-freq, the layout rule under --recover, the auxiliary-loss
gradient of a padding microbatch, and the commit lane's side sums.

Run: .venv/bin/python -m pytest tests/unit/test_moe.py   (no MPI, no GPU)
"""

import argparse

import pytest
import torch

from megatron_recover.megatron.adapters import hooks
from megatron_recover.megatron.config import moe_arguments
from megatron_recover.recovery.checks.side_sums import SideSums
from megatron_recover.recovery.lane import CommitLane, LaneHead
from megatron_recover.recovery.ledger import Entry, LaneLayout, Ledger
from megatron_recover.recovery.trainer import share

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_shards_in_step_run_passes_of_one_length(shards):
    for count in range(0, 13):
        ids = list(range(100, 100 + count))
        shares = [share(ids, s, shards, in_step=True) for s in range(shards)]
        assert sorted(k for mine, _ in shares for k in mine) == ids  # each id once
        lengths = {len(mine) + padding for mine, padding in shares}
        assert lengths == {-(-count // shards)}  # all pass lengths equal the longest share
        unpadded = [share(ids, s, shards, in_step=False) for s in range(shards)]
        assert [padding for _, padding in unpadded] == [0] * shards
        assert [mine for mine, _ in unpadded] == [mine for mine, _ in shares]


def test_layer_pattern_reads_megatron_lm_forms():
    assert moe_arguments.layer_pattern("1", 4) == (1, 1, 1, 1)
    assert moe_arguments.layer_pattern("2", 4) == (1, 0, 1, 0)
    assert moe_arguments.layer_pattern("([0]+[1]*3)*2", 8) == (0, 1, 1, 1, 0, 1, 1, 1)
    assert "one per layer" in moe_arguments.layer_pattern("[1,0]", 4)
    assert "0s and 1s" in moe_arguments.layer_pattern("[2,0]", 2)
    assert "interval" in moe_arguments.layer_pattern("__import__('os')", 2)


def _ns(**given):
    parser = argparse.ArgumentParser()
    moe_arguments.add_moe_args(parser)
    ns = parser.parse_args([])
    base = dict(num_layers=2, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                sequence_parallel=False, recover=True, use_distributed_optimizer=True,
                ckpt_format=None,
                num_distributed_optimizer_instances=3, recompute_granularity=None)
    for key, value in {**base, **given}.items():
        setattr(ns, key, value)
    return ns


def test_recover_keeps_expert_parallel_groups_inside_a_replica():
    # 12 data-parallel ranks: 3 instances of 4 hold EP 2 or 4; 4 instances of 3 cannot hold 2.
    assert moe_arguments.problems(_ns(num_experts=4, expert_model_parallel_size=4), 12) == []
    (problem,) = moe_arguments.problems(
        _ns(num_experts=4, expert_model_parallel_size=2, num_distributed_optimizer_instances=4),
        12)
    assert "does not divide the 3 data-parallel ranks of a replica" in problem
    (problem,) = moe_arguments.problems(
        _ns(num_experts=4, expert_model_parallel_size=2, use_distributed_optimizer=False,
            num_distributed_optimizer_instances=None), 12)
    assert "--num-distributed-optimizer-instances K" in problem
    # Stock runs spread experts over any data-parallel ranks; EP 1 needs no instances.
    assert moe_arguments.problems(_ns(num_experts=4, expert_model_parallel_size=2,
                                      recover=False, use_distributed_optimizer=False,
                                      num_distributed_optimizer_instances=None), 12) == []
    assert moe_arguments.problems(_ns(num_experts=4, use_distributed_optimizer=False,
                                      num_distributed_optimizer_instances=None), 12) == []
    # --ckpt-format torch keeps one expert-parallel rank's experts per position: refused.
    (problem,) = moe_arguments.problems(
        _ns(num_experts=4, expert_model_parallel_size=2, ckpt_format="torch"), 12)
    assert "use --ckpt-format torch_dist" in problem


def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    (problem,) = moe_arguments.problems(_ns(num_experts=4, tensor_model_parallel_size=2), 24)
    assert "--sequence-parallel" in problem
    assert moe_arguments.problems(_ns(num_experts=4, tensor_model_parallel_size=2,
                                      sequence_parallel=True), 24) == []


def test_a_padding_forward_gives_its_aux_losses_no_gradient():
    scale = torch.tensor(0.25)
    assert hooks.aux_loss_backward_scale(scale, padding=False) is scale
    assert float(hooks.aux_loss_backward_scale(scale, padding=True)) == 0.0
    with hooks.padding_forward(True):
        assert hooks.in_padding()
    assert not hooks.in_padding()


def test_side_sums_ride_the_lane_weighted_by_the_sent_ledger():
    """The side-sums check's lane segment is its values for the sent ledger's microbatches
    (each counted as often as the ledger holds it); a rank that sent nothing sends zeros."""
    check = SideSums(3, lambda iteration, counts: [float(sum(n * (k + 1) for k, n in
                                                             counts.items())), 2.0, 3.0])
    lane = CommitLane(LaneLayout(4, reserve=False), [(check.name, check.lane_size)])
    ledger = Ledger()
    ledger.register(Entry(1, 2, 7))
    ledger.register(Entry(1, 2, 7))
    one = lane.encode(LaneHead(1.5, 3, False), ledger, 1,
                      parts={check.name: check.lane(None, 1, ledger)})
    two = lane.encode(LaneHead(0.5, 1, False), None, 1)
    assert check.lane(None, 1, None) is None
    assert lane.decode_parts(one + two)[check.name].tolist() == [6.0, 2.0, 3.0]
    assert lane.decode_head(one + two).loss_sum == 2.0
    assert lane.decode_ledger(one + two).count == 2
