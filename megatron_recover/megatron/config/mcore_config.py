"""The pinned megatron-core's (0.19.0) config objects built from a `TrainConfig`.

One builder per object the entry point hands to megatron-core; each maps our fields to
megatron-core's names as Megatron-LM's own set-up does (megatron/training: read at core_v0.16.1,
spot-checked at core_v0.19.0, whose argument_utils.py sets the pipeline fields alike).
"""

from __future__ import annotations

from megatron_recover.megatron.config.train_config import TrainConfig


def padded_vocab_size(cfg: TrainConfig, vocab_size: int) -> int:
    """The tokenizer's vocabulary padded as Megatron-LM pads it: up to a multiple of
    --make-vocab-size-divisible-by x TP."""
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


# ---------------------------------------------------------------------------------------------
# megatron-core config objects
# ---------------------------------------------------------------------------------------------



def to_transformer_config(cfg: TrainConfig):
    """megatron-core TransformerConfig for the GPT model, as Megatron-LM builds it from its args.

    Every fusion is off: their kernels come from Apex or Megatron's compiled extensions, which a
    megatron-core install alone does not have (and never on CPU); with Transformer Engine's layer
    spec, TE's own fused paths apply regardless. Position embeddings and the vocabulary are
    GPTModel arguments, not part of this config.
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    m, p, par = cfg.model, cfg.precision, cfg.parallel
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, kv_channels=m.kv_channels,
        num_query_groups=m.num_query_groups,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        normalization=m.normalization, layernorm_epsilon=m.norm_epsilon,
        # Megatron-LM keeps the QKV bias in step with --disable-bias-linear.
        add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_bias_linear,
        gated_linear_unit=m.swiglu, activation_func=F.silu if m.swiglu else F.gelu,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_stages,
        microbatch_group_size_per_vp_stage=par.microbatch_group_size,
        # Megatron-LM's: the interleaved schedule overlaps its sends and receives unless
        # --no-overlap-p2p-communication; the plain one batches them.
        overlap_p2p_comm=bool(par.virtual_pipeline_stages) and par.overlap_p2p_comm,
        batch_p2p_comm=not (par.virtual_pipeline_stages and par.overlap_p2p_comm),
        overlap_p2p_comm_warmup_flush=par.overlap_p2p_comm_warmup_flush,
        sequence_parallel=par.sequence_parallel,
        use_cpu_initialization=par.use_cpu_initialization,
        gradient_accumulation_fusion=par.gradient_accumulation_fusion,
        fp16=p.fp16, bf16=p.bf16, params_dtype=p.params_dtype, pipeline_dtype=p.params_dtype,
        attention_softmax_in_fp32=p.attention_softmax_in_fp32,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
        deallocate_pipeline_outputs=True,  # as Megatron-LM sets it
        layernorm_zero_centered_gamma=m.apply_layernorm_1p, qk_layernorm=m.qk_layernorm,
        # The local spec runs megatron-core's own attention whatever the backend says.
        attention_backend=(AttnBackend[m.attention_backend]
                           if m.transformer_impl == "transformer_engine" else AttnBackend.auto),
        cross_entropy_loss_fusion=m.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=m.cross_entropy_fusion_impl,
        recompute_granularity=m.recompute_granularity, recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        calculate_per_token_loss=m.calculate_per_token_loss,
        expert_model_parallel_size=par.expert_model_parallel_size,
        **_moe_fields(m.moe),
    )


def _moe_fields(moe) -> dict:
    """TransformerConfig's mixture-of-experts fields (none for a dense model)."""
    if moe is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts, moe_layer_freq=list(moe.layer_pattern),
        moe_ffn_hidden_size=moe.ffn_hidden_size, moe_router_topk=moe.router_topk,
        moe_router_load_balancing_type=moe.load_balancing_type,
        moe_aux_loss_coeff=moe.aux_loss_coeff, moe_z_loss_coeff=moe.z_loss_coeff,
        moe_token_dispatcher_type=moe.token_dispatcher_type,
        moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
        moe_expert_capacity_factor=moe.expert_capacity_factor,
        moe_pad_expert_input_to_capacity=moe.pad_expert_input_to_capacity,
        moe_token_drop_policy=moe.token_drop_policy,
        moe_router_pre_softmax=moe.router_pre_softmax,
        moe_router_score_function=moe.router_score_function,
        moe_router_topk_scaling_factor=moe.router_topk_scaling_factor,
        moe_router_dtype=moe.router_dtype, moe_router_num_groups=moe.router_num_groups,
        moe_router_group_topk=moe.router_group_topk,
        moe_per_layer_logging=moe.per_layer_logging, moe_grouped_gemm=moe.grouped_gemm,
        moe_permute_fusion=moe.permute_fusion, moe_router_fusion=moe.router_fusion,
    )


def to_ddp_config(cfg: TrainConfig):
    """megatron-core DistributedDataParallelConfig (gradient buffers, buckets, reduction)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    par = cfg.parallel
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.precision.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=par.overlap_grad_reduce,
        overlap_param_gather=par.overlap_param_gather,
        use_distributed_optimizer=par.use_distributed_optimizer,
        num_distributed_optimizer_instances=par.num_distributed_optimizer_instances,
        # megatron-core's default, from the job's data-parallel size: a standby instance's
        # DDP (whose own data-parallel group is one instance) must cut the same buckets.
        bucket_size=(par.ddp_bucket_size if par.ddp_bucket_size is not None
                     else max(40_000_000, 1_000_000 * par.data_parallel_size)),
        # Megatron's bucket check before the data-parallel reduction. Under --recover the
        # buckets' reductions are ours, and so is the check (recovery/gradients.py).
        check_for_nan_in_grad=(cfg.precision.check_for_nan_in_loss_and_grad
                               and not cfg.recover.enabled),
    )


def to_optimizer_config(cfg: TrainConfig):
    """megatron-core OptimizerConfig for Adam (Megatron-LM's only optimizer we accept)."""
    from megatron.core.optimizer import OptimizerConfig

    o, p = cfg.optim, cfg.precision
    return OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, decoupled_lr=o.decoupled_lr, decoupled_min_lr=o.decoupled_min_lr,
        fp16=p.fp16, bf16=p.bf16, params_dtype=p.params_dtype,
        loss_scale=p.loss_scale, initial_loss_scale=p.initial_loss_scale,
        min_loss_scale=p.min_loss_scale, loss_scale_window=p.loss_scale_window,
        hysteresis=p.hysteresis,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
    )


def to_scheduler_kwargs(cfg: TrainConfig) -> dict:
    """Keyword arguments of megatron-core's OptimizerParamScheduler (all but `optimizer`).

    Steps are samples, as in Megatron-LM: the caller steps the scheduler by the iteration's
    global batch size (= B x micro_batch_size) once per committed iteration. On a load, values
    that differ from the checkpoint's stop it unless one of the two override flags says which
    side wins (megatron-core's own default is the checkpoint's; Megatron-LM's is neither).
    """
    o = cfg.optim
    return dict(
        init_lr=o.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_samples, lr_decay_steps=o.lr_decay_samples,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.start_weight_decay, end_wd=o.end_weight_decay,
        wd_incr_steps=cfg.train_samples, wd_incr_style=o.weight_decay_incr_style,
        wsd_decay_steps=o.lr_wsd_decay_samples,
        lr_wsd_decay_style=o.lr_wsd_decay_style,
        override_opt_param_scheduler=o.override_scheduler,
        use_checkpoint_opt_param_scheduler=o.use_checkpoint_scheduler,
    )


def to_policy_config(cfg: TrainConfig):
    """The layer-3 PolicyConfig: W_init replicas, G_init microbatch ids each, policy and mode,
    the B of each iteration of a batch-size ramp-up, and the straggler settings."""
    from megatron_recover.policy import PolicyConfig
    from megatron_recover.policy.speed import StragglerConfig

    ramp = tuple(size // cfg.micro_batch_size for size in cfg.global_batches.ramp)
    recover = cfg.recover
    return PolicyConfig(w_init=cfg.num_replicas, g_init=cfg.num_microbatches_per_replica,
                        policy=recover.policy, mode=recover.mode, ramp=ramp,
                        straggler=StragglerConfig(recover.straggler_threshold,
                                                  recover.straggler_window,
                                                  recover.evict_slower_than))


def model_flops(model, padded_vocab_size: int, batch_size: int) -> float:
    """Megatron-LM's model FLOPs of one iteration of a dense GPT (its
    num_floating_point_operations): forward and backward are 3 x the forward's 2 FLOPs per
    multiply-add, over the query/key/value and output projections (keys and values per query
    group), the attention scores and their values (half of them: the causal mask, as Megatron-LM
    counts, core_v0.19.0 as core_v0.16.1), the MLP (x 3/2 gated with SwiGLU) and the logits, for
    batch_size sequences of seq_length tokens. `model` is a ModelConfig."""
    s, h, layers = model.seq_length, model.hidden_size, model.num_layers
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    query_ratio = model.kv_channels * heads / h
    attention = (1 + groups / heads + s / (2 * h)) * query_ratio
    mlp = model.ffn_hidden_size / h * (1.5 if model.swiglu else 1.0)
    logits = padded_vocab_size / (2 * layers * h)
    return 12 * batch_size * s * layers * h * h * (attention + mlp + logits)
