"""What a checkpoint holds besides the model and optimizer state, in Megatron-LM's terms, for
both formats (`torch_dist.py`: torch_dist; `torch_format.py`: torch): the common keys of its
save_checkpoint, its names of the random number generators, the data position its loader takes,
and the key of the --recover state.

The facts come from Megatron-LM's megatron/training/checkpointing.py at core_v0.16.1, and hold
at core_v0.19.0 (docs/checkpoints.md, "Against Megatron-LM").
"""

import argparse

from megatron_recover.megatron.persistence import training_state
from megatron_recover.megatron.config.mcore_config import model_flops

RECOVERY_KEY = "recover_state"  # the --recover state, beside Megatron-LM's keys
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version

# Megatron-LM's names for the generators of `state.capture_rng` in a checkpoint's rng_state.
_RNG_NAMES = {"random": "random_rng_state", "numpy": "np_rng_state",
              "torch": "torch_rng_state", "cuda": "cuda_rng_state",
              "tracker": "rng_tracker_states"}


def rng_state() -> dict:
    """This rank's generators under Megatron-LM's names (one entry of its rng_state list)."""
    return {_RNG_NAMES[k]: v for k, v in training_state.capture_rng().items()}


def restore_rng_state(saved: dict) -> None:
    training_state.restore_rng({k: saved[name] for k, name in _RNG_NAMES.items()})


def megatron_common(cfg, iteration: int, padded_vocab_size: int) -> dict:
    """The common keys Megatron-LM's save_checkpoint writes beside the model, optimizer,
    scheduler and RNG state: `checkpoint_version`, `num_floating_point_operations_so_far` and
    `args`. Megatron-LM saves its whole argument namespace; this one holds the arguments its
    load_checkpoint and check_checkpoint_args read (the data position, the model shape and
    vocabulary, the parallel sizes, what was saved)."""
    samples = cfg.global_batches.first_sample(iteration + 1)
    evaluations = sum(cfg.evaluation.due(t) for t in range(1, iteration + 1))
    model, parallel = cfg.model, cfg.parallel
    args = argparse.Namespace(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        add_position_embedding=model.position_embedding_type == "learned_absolute",
        max_position_embeddings=model.max_position_embeddings,
        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size, tokenizer_type=cfg.data.tokenizer_type,
        vocab_file=cfg.data.vocab_file,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_stages,
        data_parallel_size=cfg.data_parallel_size, world_size=parallel.world_size,
        micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.eval_global_batch_size,
        consumed_train_samples=samples, skipped_train_samples=0,
        consumed_valid_samples=evaluations * cfg.evaluation.iters * cfg.eval_global_batch_size,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        ckpt_format="torch_dist", ckpt_fully_parallel_save=True, no_save_optim=False,
        no_save_rng=False, data_parallel_random_init=False)
    return {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
            "num_floating_point_operations_so_far": model_flops(model, padded_vocab_size,
                                                                samples)}


def check_data_position(saved_args, iteration: int, cfg) -> None:
    """A resumed run's data continues at the iteration's first sample, which this run's batch
    sizes give: the checkpoint's consumed samples (Megatron-LM's `args`) must agree."""
    consumed = getattr(saved_args, "consumed_train_samples", None)
    expected = cfg.global_batches.first_sample(iteration + 1)
    if consumed is not None and consumed != expected:
        raise ValueError(f"--load: the checkpoint consumed {consumed} training samples by "
                         f"iteration {iteration}, while this run's batch sizes give {expected}: "
                         "resume with the --global-batch-size or --step-batch-size-schedule it "
                         "was written with")
