"""Device discipline on a machine without a GPU: what a rank trains with is on its device.

The CPU emulation records which tensors were placed on an emulated device
(`megatron_recover.testing.on_device`): created there or moved there, as on a GPU, where a
forgotten move leaves a tensor on the host. One rank builds its model as pretrain_gpt_recover.py
does (`run.build`), runs a microbatch through `MicrobatchPass` and hands its gradient buckets to
layer 2's reduction; the test then checks the model's parameters, the inputs the model received,
every bucket handed to the ulfm group and every bucket snapshot. Two mutations (the model move
and the batch move removed) must each fail the check.

Run: .venv/bin/python -m pytest tests/unit/test_device_discipline.py (CPU only, seconds).
"""

import tempfile

import pytest
import torch

from megatron_recover.megatron.config.arguments import parse_args
from megatron_recover.testing.fake_ulfm import FakeGroup, FakeWorld

pytestmark = pytest.mark.unit

SMALL = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 "
         "--train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
         "--vocab-size 64 --position-embedding-type learned_absolute").split()


class RecordingGroup(FakeGroup):
    """A one-member ulfm group that records the tensors handed to it."""

    def __init__(self):
        super().__init__(FakeWorld([0]), 0)
        self.handed = []

    def allreduce(self, tensor):
        self.handed.append(tensor)
        return super().allreduce(tensor)


def places():
    """What one rank trains with, and whether each is on its device: {what: on_device}."""
    from megatron.core import parallel_state

    import pretrain_gpt_recover as entry
    from megatron_recover import runtime
    from megatron_recover.megatron.app import run
    from megatron_recover.megatron.adapters.trainer_parts import DDPBuffers
    from megatron_recover.recovery.gradients import GradientRecovery
    from megatron_recover.testing import cpu_emulation_enabled, on_device

    cfg = parse_args(SMALL, world_size=1, cuda_available=False)
    found = {}
    with cpu_emulation_enabled(), tempfile.TemporaryDirectory() as store:
        source, vocab_size = run.microbatch_source(cfg)  # before torch.distributed, as run.py
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}/store",
                                             rank=0, world_size=1)
        try:
            ctx = runtime.DistributedContext(rank=0, world_size=1, status_path=None)
            setup = run.build(cfg, ctx, vocab_size, entry.model_provider)
            (ddp_model,) = setup.chunks  # one model chunk (no virtual stages)
            for name, param in ddp_model.named_parameters():
                found[f"parameter {name}"] = on_device(param)
            model = setup.unwrapped_model()

            def record_inputs(module, args, kwargs):
                names = ("input_ids", "position_ids", "attention_mask")
                for name, value in [*zip(names, args), *kwargs.items()]:
                    if isinstance(value, torch.Tensor):
                        found[f"input {name}"] = on_device(value)

            hook = model.register_forward_pre_hook(record_inputs, with_kwargs=True)
            micro_pass = run._micro_pass(cfg, ctx, setup, source.microbatch, None,
                                         entry.forward_step)
            group = RecordingGroup()
            recovery = GradientRecovery(group, DDPBuffers(setup.chunks, False).buckets())
            recovery.begin_iteration()
            recovery.begin_pass()
            micro_pass.run(1, [0], {}, {})
            hook.remove()
            recovery.reduce_all()
            recovery.wait()
            for index, tensor in enumerate(group.handed):
                found[f"bucket {index} handed to ulfm"] = on_device(tensor)
            for index, tensor in enumerate(recovery.snapshots()):
                found[f"bucket {index} snapshot"] = on_device(tensor)
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    return found


def off_device(found: dict) -> list[str]:
    return sorted(what for what, placed in found.items() if not placed)


def test_parameters_inputs_buckets_and_snapshots_are_on_the_device():
    found = places()
    # Each kind was seen (an empty check proves nothing): parameters, the three model inputs
    # (labels reach the model as a keyword), buckets handed to the group and their snapshots.
    kinds = {what.split()[0] for what in found}
    assert kinds == {"parameter", "input", "bucket"}, found
    assert {"input input_ids", "input position_ids", "input labels"} <= set(found), found
    assert any("handed to ulfm" in what for what in found)
    assert any("snapshot" in what for what in found)
    assert off_device(found) == []


def test_a_model_left_on_the_host_is_caught(monkeypatch):
    from megatron_recover.megatron.adapters import devices

    monkeypatch.setattr(devices, "model_to_device", lambda model: model)
    missed = off_device(places())
    print("CAUGHT model move removed:", missed)
    # megatron-core builds most parameters on the device itself; its learned position
    # embedding is a torch.nn.Embedding on the host until the model is moved.
    assert "parameter module.embedding.position_embeddings.weight" in missed


def test_a_batch_left_on_the_host_is_caught(monkeypatch):
    from megatron_recover.megatron.adapters import devices

    monkeypatch.setattr(devices, "batch_to_device", lambda batch: batch)
    missed = off_device(places())
    print("CAUGHT batch move removed:", missed)
    assert {"input input_ids", "input position_ids", "input labels"} <= set(missed)
