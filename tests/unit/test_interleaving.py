"""The interleaved schedule's pass shapes (`megatron/interleaving.py`) and the ledger kept per
model chunk (`GradientRecovery.register(..., chunk)`, the pass runner's ledger sink).

Run: .venv/bin/python -m pytest tests/unit/test_interleaving.py   (no MPI, no GPU)

The shapes are checked against megatron-core's own rule (`interleaving.problem`, the conditions
of forward_backward_pipelining_with_interleaving at 0.16.1) for every pass length up to 40: a
shaped pass is one megatron accepts, padding appears only below the pipeline size, and the
configured group size is kept whenever megatron accepts it. The ledger: each microbatch lands in
the buckets of the chunk that consumed it, so a chunk that skipped an id makes its buckets' sent
ledgers differ from the other chunk's, which the commit lane reports as poison.
"""

import pytest
import torch

from megatron_recover.megatron.adapters import interleaving
from megatron_recover.recovery.gradients import GradientRecovery

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("pipeline", [2, 3, 4])
def test_every_shaped_pass_is_one_megatron_accepts(pipeline):
    for group_size in range(pipeline, 3 * pipeline + 1):
        for microbatches in range(1, 41):
            padding, used = interleaving.shape(microbatches, group_size, pipeline)
            total = microbatches + padding
            assert interleaving.problem(total, used, pipeline) is None
            assert padding == max(0, pipeline - microbatches)
            if interleaving.problem(microbatches, group_size, pipeline) is None:
                assert (padding, used) == (0, group_size)  # megatron's own schedule, unchanged


def test_megatrons_rule_as_its_schedule_states_it():
    assert interleaving.problem(4, 2, 2) is None
    assert interleaving.problem(5, 3, 2) is None  # remainder 2 >= PP
    assert "should range in [PP=2, M=1]" in interleaving.problem(1, 2, 2)
    assert "but it is 1" in interleaving.problem(3, 2, 2)
    assert interleaving.shape(1, 2, 2) == (1, 2)
    assert interleaving.shape(3, 2, 2) == (0, 3)


class _Config:
    microbatch_group_size_per_vp_stage = 2


def test_a_shaped_pass_restores_the_configured_group_size():
    config = _Config()
    with interleaving.shaped_pass(config, 3, 2, chunks=2) as padding:
        assert (padding, config.microbatch_group_size_per_vp_stage) == (0, 3)
    assert config.microbatch_group_size_per_vp_stage == 2
    with pytest.raises(RuntimeError):
        with interleaving.shaped_pass(config, 1, 2, chunks=2) as padding:
            assert padding == 1
            raise RuntimeError("the schedule failed")
    assert config.microbatch_group_size_per_vp_stage == 2
    with interleaving.shaped_pass(config, 1, 2, chunks=1) as padding:  # no virtual stages
        assert (padding, config.microbatch_group_size_per_vp_stage) == (0, 2)


def _two_chunks():
    """Chunk 0 with two buckets, chunk 1 with one; reductions recorded, not posted."""
    first, second, last = torch.zeros(3), torch.zeros(2), torch.zeros(4)
    recovery = GradientRecovery(None, [last, first, second],
                                chunk_buckets=[[first, second], [last]])
    recovery._post = lambda bucket: None
    recovery.begin_iteration()
    recovery.begin_pass()
    return recovery


def test_each_chunk_registers_what_it_consumed():
    recovery = _two_chunks()
    for microbatch in (0, 1):
        for chunk in (0, 1):
            recovery.register(3, microbatch, 100 + microbatch, chunk=chunk)
    recovery.reduce_all()
    sent, same = recovery.sent_ledger()
    assert same and len(sent) == 2  # each id once per bucket, not once per chunk
    assert sorted(entry.microbatch_id for entry in sent.entries) == [0, 1]


def test_a_chunk_that_skipped_an_id_is_seen():
    recovery = _two_chunks()
    for chunk in (0, 1):
        recovery.register(3, 0, 100, chunk=chunk)
    recovery.register(3, 1, 101, chunk=0)  # chunk 1 never ran microbatch 1
    recovery.reduce_all()
    _, same = recovery.sent_ledger()
    assert not same
