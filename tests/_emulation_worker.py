"""One rank of a tiny megatron-core GPT training run under CPU emulation (no GPU needed).

Started by tests/test_cpu_emulation.py, one process per rank:

    python tests/_emulation_worker.py --rank R --world-size N --store-port P \
        --tp T --pp P --iterations 3 --out DIR

It joins a gloo process group through the TCP store the test hosts on 127.0.0.1, builds a 2-layer
GPTModel (local layer spec, fp32, no dropout) wrapped in Megatron's DistributedDataParallel, and
trains it with `get_forward_backward_func()` and Megatron's optimizer. It writes `DIR/rank<R>.json`
(per-iteration loss, grad norm, parameter digests) and `DIR/init<R>.pt` (the main-replica pieces of
megatron's own initialization, for the test to assemble).

Every layout trains the same model on the same data: after megatron initializes it, each parameter
is overwritten from a generator seeded by its checkpoint key (layout-independent, see
`_initialize_by_key`), and each iteration's global batch is GLOBAL_MICROBATCHES fixed microbatches,
split across data-parallel ranks in rank order.
"""

import argparse
import datetime
import functools
import hashlib
import json
import os
import sys
import zlib

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

from megatron_recover.testing import enable_cpu_emulation

SEED = 1234
VOCAB_SIZE = 128
SEQ_LENGTH = 16
HIDDEN_SIZE = 32
NUM_HEADS = 4
NUM_LAYERS = 2
MICRO_BATCH_SIZE = 1
GLOBAL_MICROBATCHES = 2
INIT_STD = 0.02
# Checkpoint keys of LayerNorm scales (the local spec maps the layer norms to TE-style names); they
# are initialized around 1 like megatron's, the other parameters around 0.
_NORM_WEIGHT_SUFFIXES = ("layer_norm_weight", "layernorm.weight")
TIMEOUT = datetime.timedelta(seconds=60)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def init_distributed(args):
    """Join the world over gloo and build Megatron's TP / PP / DP groups."""
    store = torch.distributed.TCPStore(
        "127.0.0.1", args.store_port, is_master=False, timeout=TIMEOUT
    )
    torch.distributed.init_process_group(
        "gloo", store=store, rank=args.rank, world_size=args.world_size, timeout=TIMEOUT
    )
    # Every group is gloo already (the world's backend), so the extra gloo copies are not needed.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        create_gloo_process_groups=False,
    )
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)


def build_model(args):
    """The 2-layer GPTModel of this rank's pipeline stage, with megatron's CPU initialization."""
    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN_SIZE,
        num_attention_heads=NUM_HEADS,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        pipeline_dtype=torch.float32,
        # Initialize each TP shard as a slice of the full weight drawn on the host, so that
        # megatron's own init does not depend on the TP size.
        use_cpu_initialization=True,
        init_method_std=INIT_STD,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The fused paths need apex / torch.compile; the plain ones are what we emulate.
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
    )
    return model, config


def main_replica_pieces(model):
    """[(key, global_shape, index, local values)] for the tensors this rank holds the main copy of.

    `index` selects the local piece inside the global tensor, so a test can assemble the global
    tensor from every rank's pieces whatever the TP / PP layout. One key can have several pieces
    (the layers of a stage share a key and differ in the prepended layer axis).
    """
    sharded, _ = extract_sharded_tensors(model.sharded_state_dict())
    pieces = []
    for sharded_tensor in sharded.values():
        assert isinstance(sharded_tensor, ShardedTensor)
        if is_main_replica(sharded_tensor.replica_id):
            pieces.append((
                sharded_tensor.key,
                tuple(sharded_tensor.global_shape),
                _local_index(sharded_tensor),
                sharded_tensor.data.detach().clone(),
            ))
    return pieces


def _local_index(sharded_tensor):
    """Index of the local data in the global tensor (prepended axes, e.g. the layer, are ints)."""
    prepend = sharded_tensor.prepend_axis_num
    offsets = sharded_tensor.global_offset
    return tuple(offsets[:prepend]) + tuple(
        slice(offset, offset + size)
        for offset, size in zip(offsets[prepend:], sharded_tensor.data.shape)
    )


def _initialize_by_key(model):
    """Overwrite every parameter with its slice of a global tensor seeded by its checkpoint key.

    megatron's own init draws layer after layer from one RNG stream, so a pipeline stage that
    builds only the second layer draws different values than a single-stage model. Checkpoint keys
    and global offsets are layout-independent (megatron's checkpoints rely on it), so this makes
    every TP / PP / DP layout start from the same full model. Tied output weights share the word
    embedding's key and therefore its values.
    """
    sharded, _ = extract_sharded_tensors(model.sharded_state_dict())
    with torch.no_grad():
        for sharded_tensor in sharded.values():
            generator = torch.Generator().manual_seed(zlib.crc32(sharded_tensor.key.encode()))
            values = INIT_STD * torch.randn(sharded_tensor.global_shape, generator=generator)
            if sharded_tensor.key.endswith(_NORM_WEIGHT_SUFFIXES):
                values += 1.0
            sharded_tensor.data.copy_(values[_local_index(sharded_tensor)])


def build_training(args):
    """(DDP-wrapped model, Megatron optimizer, megatron's init pieces), wired as Megatron does."""
    model, config = build_model(args)
    init_pieces = main_replica_pieces(model)
    _initialize_by_key(model)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True,
        # Small buckets, so that gradient reduction runs several buckets from backward hooks.
        bucket_size=4096,
    )
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, bf16=False, fp16=False),
        [ddp_model],
        use_gloo_process_groups=False,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp_model.no_sync
    return ddp_model, optimizer, init_pieces


def microbatch(iteration, microbatch_id):
    """The fixed microbatch `microbatch_id` of the global batch of `iteration` (from 1)."""
    generator = torch.Generator().manual_seed(SEED + 1000 * iteration + microbatch_id)
    sample = torch.randint(
        0, VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LENGTH + 1), generator=generator
    )
    return {
        "tokens": sample[:, :-1],
        "labels": sample[:, 1:],
        "loss_mask": torch.ones(MICRO_BATCH_SIZE, SEQ_LENGTH),
        "position_ids": torch.arange(SEQ_LENGTH).unsqueeze(0).expand(MICRO_BATCH_SIZE, -1),
    }


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    loss = torch.sum(losses * loss_mask.view(-1)) / loss_mask.sum()
    # The schedule divides the loss in place by the microbatch count; report the undivided one.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    # attention_mask=None: the local spec's softmax builds the causal mask itself.
    output = model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"]
    )
    return output, functools.partial(loss_func, batch["loss_mask"])


def train_iteration(iteration, ddp_model, optimizer):
    """One iteration; returns (global-batch loss on the last stage else None, grad norm)."""
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    num_microbatches = GLOBAL_MICROBATCHES // dp_size
    first_id = dp_rank * num_microbatches
    batches = [microbatch(iteration, first_id + k) for k in range(num_microbatches)]

    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[ddp_model],
        num_microbatches=num_microbatches,
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful, f"optimizer step {iteration} was skipped"
    if not parallel_state.is_pipeline_last_stage():
        return None, grad_norm
    local = torch.stack([entry["lm loss"] for entry in losses]).mean()
    torch.distributed.all_reduce(local, group=parallel_state.get_data_parallel_group())
    return (local / dp_size).item(), grad_norm


def parameter_digest(model):
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().numpy().tobytes())
    return digest.hexdigest()


def main(argv):
    args = parse_args(argv)
    # The machine has few cores and the test runs several ranks at once.
    torch.set_num_threads(1)
    # megatron-core is already imported: emulation must (and does) work when enabled afterwards.
    enable_cpu_emulation()
    init_distributed(args)
    ddp_model, optimizer, init_pieces = build_training(args)
    record = {
        "rank": args.rank,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "losses": [],
        "grad_norms": [],
        "param_digests": [parameter_digest(ddp_model.module)],
    }
    for iteration in range(1, args.iterations + 1):
        loss, grad_norm = train_iteration(iteration, ddp_model, optimizer)
        record["losses"].append(loss)
        record["grad_norms"].append(grad_norm)
        record["param_digests"].append(parameter_digest(ddp_model.module))

    torch.save(init_pieces, os.path.join(args.out, f"init{args.rank}.pt"))
    with open(os.path.join(args.out, f"rank{args.rank}.json"), "w") as f:
        json.dump(record, f)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
