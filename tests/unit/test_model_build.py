"""What the arguments build, in one process (a gloo world of one rank): the rotary embedding of
--rotary-base/--rotary-percent, Megatron-LM's per-stage seed, and where the learning-rate
scheduler's values come from on a load (--override-opt-param-scheduler,
--use-checkpoint-opt-param-scheduler, neither). The expected values are computed here from the
formulas, not by the code under test.

Run: .venv/bin/python -m pytest tests/unit/test_model_build.py
"""

import random
import tempfile
from functools import partial

import numpy as np
import pytest
import torch

from megatron_recover.megatron.config import mcore_config
from megatron_recover.megatron.config.arguments import parse_args

pytestmark = pytest.mark.unit

SMALL = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--max-position-embeddings 16 --micro-batch-size 1 --train-iters 10 --lr 1e-3 "
         "--mock-data --tokenizer-type NullTokenizer --vocab-size 64").split()


def config(*extra):
    return parse_args([*SMALL, *extra], world_size=1, cuda_available=False)


@pytest.fixture
def one_rank():
    from megatron.core import parallel_state

    from megatron_recover.testing.cpu_emulation import cpu_emulation_enabled

    with cpu_emulation_enabled(), tempfile.TemporaryDirectory() as store:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}/store",
                                             rank=0, world_size=1)
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


def test_rotary_base_and_percent_reach_the_model(one_rank):
    from megatron_recover.megatron.adapters.gpt import build_gpt, seed_stage

    cfg = config("--position-embedding-type", "rope", "--rotary-base", "500000",
                 "--rotary-percent", "0.5")
    seed_stage(cfg.seed)
    model = build_gpt(mcore_config.to_transformer_config(cfg), 64, cfg.model)
    dim = int(32 // 4 * 0.5)  # kv channels x rotary percent
    expected = 1.0 / (500000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    inv_freq = model.rotary_pos_emb.inv_freq.cpu()
    assert inv_freq.shape == expected.shape and torch.allclose(inv_freq, expected, rtol=1e-6)


def test_seed_is_megatrons_per_stage_seed(one_rank):
    from megatron_recover.megatron.adapters.gpt import seed_stage

    seed_stage(1234)  # pipeline stage 0 of 1: the seed itself
    drawn = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    assert drawn == (random.random(), float(np.random.rand()), float(torch.rand(1)))
    with pytest.raises(ValueError, match="--seed must be a positive integer, got 0"):
        config("--seed", "0")


def scheduler(cfg):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return OptimizerParamScheduler(optimizer, **mcore_config.to_scheduler_kwargs(cfg))


def test_on_a_load_the_scheduler_values_come_from_where_megatron_lm_says():
    saved = scheduler(config()).state_dict()  # --lr 1e-3
    with pytest.raises(AssertionError, match="do not match"):  # Megatron-LM's default
        scheduler(config("--lr", "3e-3")).load_state_dict(saved)
    overridden = scheduler(config("--lr", "3e-3", "--override-opt-param-scheduler"))
    overridden.load_state_dict(saved)
    assert overridden.max_lr == 3e-3
    from_checkpoint = scheduler(config("--lr", "3e-3", "--use-checkpoint-opt_param-scheduler"))
    from_checkpoint.load_state_dict(saved)
    assert from_checkpoint.max_lr == 1e-3
    with pytest.raises(ValueError, match="contradict each other"):
        config("--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler")


def test_the_loss_check_and_the_nan_gradient_of_the_failure_schedule():
    from pretrain_gpt_recover import loss_func
    from megatron_recover import errors
    from megatron_recover.megatron.adapters.gpt import _loss_func

    user_loss = partial(loss_func, torch.ones(1, 4))  # the entry's, its loss mask bound
    never = lambda: False  # noqa: E731
    output = torch.tensor([[1.0, 2.0, float("nan"), 3.0]])
    with pytest.raises(errors.NonFiniteLoss, match="found NaN in local forward loss"):
        _loss_func(user_loss, 0, never, never, False, True, output)
    with pytest.raises(errors.NonFiniteLoss, match="found Inf in local forward loss"):
        _loss_func(user_loss, 0, never, never, False, True,
                   output.nan_to_num(posinf=0) + float("inf"))
    loss, _ = _loss_func(user_loss, 0, never, never, False, False, output)  # unchecked: it passes
    assert torch.isnan(loss)
    # The `nan` action: the loss stays right, its gradient is NaN.
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    loss, report = _loss_func(user_loss, 0, lambda: True, never, False, True, logits)
    assert float(loss) == 2.5 and float(report["lm loss"]) == 10.0
    loss.backward()
    assert torch.isnan(logits.grad).all()


def test_the_seams_are_held_to_megatron_lms_contract(one_rank):
    """A user's model provider must build with the run's `config`; a loss function must return
    Megatron-LM's (loss sum, token count, report). The entry's provider passes."""
    import pretrain_gpt_recover as entry
    from megatron_recover.megatron.adapters.gpt import (
        build_gpt,
        build_model_chunks,
        get_args,
        loss_and_tokens,
    )

    with pytest.raises(TypeError, match=r"must return \(loss summed .* got a tuple of 2"):
        loss_and_tokens((torch.tensor(1.0), {}))
    loss, tokens = loss_and_tokens((torch.tensor(6.0), torch.tensor(3, dtype=torch.int), {}))
    assert (float(loss), tokens.dtype, float(tokens)) == (6.0, torch.float32, 3.0)
    cfg = config()
    tconfig = mcore_config.to_transformer_config(cfg)

    def own_config(pre_process=True, post_process=True, vp_stage=None, config=None):
        return build_gpt(mcore_config.to_transformer_config(cfg), get_args().padded_vocab_size,
                         cfg.model, vp_stage, pre_process, post_process)

    with pytest.raises(TypeError, match="not built with the `config` it was given"):
        build_model_chunks(own_config, cfg, tconfig, 64)
    (chunk,) = build_model_chunks(entry.model_provider, cfg, tconfig, 64)
    assert chunk.config is tconfig and get_args().padded_vocab_size == 64


@pytest.mark.parametrize("extra", [
    pytest.param(["--overlap-grad-reduce", "--ddp-bucket-size", "2000"], id="dense"),
    pytest.param(["--num-experts", "2", "--moe-router-topk", "2", "--disable-bias-linear",
                  "--num-layers", "2", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"],
                 id="moe")])
def test_buckets_are_reduced_in_the_order_backward_completes_them(one_rank, extra):
    """DDPBuffers' order (the order every replica posts its buckets in) against the order the
    gradients of a real backward arrive in (a bucket is complete when its last gradient did),
    for a dense model and one with MoE layers (whose expert weights sit inside their layers)."""
    from megatron.core.distributed import DistributedDataParallel

    from megatron_recover.megatron.adapters.trainer_parts import DDPBuffers, bucket_kinds
    from megatron_recover.megatron.adapters.gpt import build_gpt, seed_stage

    cfg = config(*extra)
    seed_stage(cfg.seed)
    tconfig = mcore_config.to_transformer_config(cfg)
    model = build_gpt(tconfig, 64, cfg.model)
    ddp = DistributedDataParallel(config=tconfig, ddp_config=mcore_config.to_ddp_config(cfg),
                                  module=model)
    arrived = {}

    def note(param):
        def hook(grad):
            arrived.setdefault(id(param), len(arrived))
        return hook

    for param in model.parameters():
        param.register_hook(note(param))
    tokens = torch.randint(0, 64, (1, 16))
    position_ids = torch.arange(16).unsqueeze(0)
    model(tokens, position_ids, None, labels=tokens).sum().backward()
    buckets = [b for g in ddp.bucket_groups + ddp.expert_parallel_bucket_groups for b in g.buckets]
    completed = sorted(buckets, key=lambda b: max(arrived[id(p)] for p in b.params))
    posted = DDPBuffers([ddp], overlap_grad_reduce=True).buckets()
    assert len(posted) > 2
    assert [b.grad_data.data_ptr() for b in completed] == [g.data_ptr() for g in posted]
    # Dense, megatron's own order. One process has expert-parallel size 1, where megatron
    # keeps the experts in the dense buffer (tests/test_moe.py has expert buckets, EP 2).
    assert posted == [b.grad_data for g in ddp.bucket_groups for b in g.buckets]
    assert set(bucket_kinds([ddp])) == {"dense"}
