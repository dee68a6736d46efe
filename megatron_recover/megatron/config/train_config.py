"""The validated configuration of one `pretrain_gpt_recover.py` run: frozen dataclasses.

`arguments.parse_args` builds a `TrainConfig` from a Megatron command line; `mcore_config` turns
it into megatron-core's config objects. Each field's docstring names the flag it comes from; the
flags' defaults are the parser's (`arguments.build_parser`), so the fields have none: every one
is set from the parsed arguments (`CheckpointConfig` aside, which tests build directly). Nothing
here parses, validates or imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_recover.policy.rampup import GlobalBatches


@dataclass(frozen=True)
class MoEConfig:
    """Megatron's mixture-of-experts MLP (megatron-core's MoELayer), from the --moe-* flags."""

    num_experts: int
    """Experts in each MoE layer (--num-experts)."""
    layer_pattern: tuple[int, ...]
    """Per layer 1 (MoE) or 0 (dense MLP) (--moe-layer-freq: an interval N, every N-th layer
    from the first, or a list expression such as "[1,0]*2")."""
    ffn_hidden_size: int
    """Each expert's hidden size (--moe-ffn-hidden-size; default --ffn-hidden-size)."""
    router_topk: int
    """Experts each token is routed to (--moe-router-topk)."""
    load_balancing_type: str
    """The router's balancing loss: aux_loss, seq_aux_loss or none
    (--moe-router-load-balancing-type)."""
    aux_loss_coeff: float
    """Its coefficient (--moe-aux-loss-coeff; 0: no loss)."""
    z_loss_coeff: float | None
    """The router's z-loss coefficient (--moe-z-loss-coeff; None: off)."""
    token_dispatcher_type: str
    """How tokens reach their experts over the expert-parallel group: allgather or alltoall
    (--moe-token-dispatcher-type)."""
    shared_expert_intermediate_size: int | None
    """The shared expert's hidden size (--moe-shared-expert-intermediate-size); None: none."""
    expert_capacity_factor: float | None
    """Tokens an expert takes per forward, as a factor of an even split; the rest are dropped
    (--moe-expert-capacity-factor; None: no dropping)."""
    pad_expert_input_to_capacity: bool
    """Pad each expert's input to its capacity (--moe-pad-expert-input-to-capacity)."""
    token_drop_policy: str
    """Which tokens an expert over capacity drops: "probs" (lowest routing probability) or
    "position" (latest in the sequence) (--moe-token-drop-policy)."""
    router_pre_softmax: bool
    """Softmax before the top-k selection (--moe-router-pre-softmax)."""
    router_score_function: str
    """softmax or sigmoid (--moe-router-score-function)."""
    router_topk_scaling_factor: float | None
    """Scales the routing probabilities (--moe-router-topk-scaling-factor)."""
    router_dtype: str | None
    """The router's compute dtype: fp32, fp64, or None: the model's (--moe-router-dtype)."""
    router_num_groups: int | None
    """Expert groups for group-limited routing (--moe-router-num-groups)."""
    router_group_topk: int | None
    """Groups each token may use (--moe-router-group-topk)."""
    per_layer_logging: bool
    """Log each layer's auxiliary losses too (--moe-per-layer-logging; TensorBoard)."""
    grouped_gemm: bool
    """One grouped GEMM over a rank's experts (--moe-grouped-gemm; a CUDA kernel)."""
    permute_fusion: bool
    """Fused token permutation (--moe-permute-fusion; Transformer Engine on CUDA)."""
    router_fusion: bool
    """Fused router top-k and aux-loss scores (--moe-router-fusion; Transformer Engine on
    CUDA)."""

    @property
    def loss_names(self) -> tuple[str, ...]:
        """The auxiliary losses the router saves, under megatron-core's tracker names."""
        names = []
        if self.load_balancing_type == "aux_loss" and self.aux_loss_coeff > 0:
            names.append("load_balancing_loss")
        if self.load_balancing_type == "seq_aux_loss" and self.aux_loss_coeff > 0:
            names.append("seq_load_balancing_loss")
        if self.z_loss_coeff is not None:
            names.append("z_loss")
        return tuple(names)


@dataclass(frozen=True)
class ModelConfig:
    """The GPT model (megatron-core GPTModel + TransformerConfig)."""

    num_layers: int
    """Number of transformer layers (--num-layers)."""
    hidden_size: int
    """Transformer hidden size (--hidden-size)."""
    ffn_hidden_size: int
    """MLP hidden size (--ffn-hidden-size); default 4*hidden, or int(4*hidden*2/3 / 64)*64 with
    --swiglu (Megatron's rule: two fc1 projections, same parameter count, a multiple of 64)."""
    num_attention_heads: int
    """Attention heads (--num-attention-heads)."""
    kv_channels: int
    """Per-head projection size (--kv-channels; default hidden_size // num_attention_heads)."""
    num_query_groups: int | None
    """Query groups with --group-query-attention (--num-query-groups), None otherwise."""
    seq_length: int
    """Tokens per sample (--seq-length)."""
    max_position_embeddings: int
    """Size of the learned position table (--max-position-embeddings); defaults to seq_length
    (Megatron-LM requires it; we accept its absence because rope models do not use it)."""
    position_embedding_type: str
    """"learned_absolute" (default) or "rope" (--position-embedding-type)."""
    rotary_base: int
    """RoPE base (--rotary-base)."""
    rotary_percent: float
    """Fraction of each head's channels that RoPE rotates (--rotary-percent)."""
    normalization: str
    """"LayerNorm" (default) or "RMSNorm" (--normalization)."""
    norm_epsilon: float
    """Epsilon of every LayerNorm/RMSNorm (--norm-epsilon)."""
    swiglu: bool
    """Gated linear unit with SiLU instead of GeLU in the MLP (--swiglu)."""
    untie_embeddings_and_output_weights: bool
    """Separate output layer instead of reusing the word embeddings (--untie-...)."""
    add_bias_linear: bool
    """Bias in every linear layer; --disable-bias-linear turns it off."""
    init_method_std: float
    """Std of the normal weight initialization (--init-method-std)."""
    hidden_dropout: float
    """Dropout on hidden states (--hidden-dropout)."""
    attention_dropout: float
    """Dropout on attention probabilities (--attention-dropout)."""
    make_vocab_size_divisible_by: int
    """The vocabulary is padded to a multiple of this times TP (--make-vocab-size-divisible-by)."""
    transformer_impl: str
    """Layer spec: "local" (megatron-core's own modules) or "transformer_engine"
    (--transformer-impl; when absent, Megatron-LM's default transformer_engine where Transformer
    Engine imports, local otherwise)."""
    apply_layernorm_1p: bool
    """Norm weights stored zero-centred and applied as (1 + weight) (--apply-layernorm-1p)."""
    qk_layernorm: bool
    """A norm on each head's queries and keys before attention (--qk-layernorm)."""
    attention_backend: str
    """--attention-backend (flash | fused | unfused | local | auto); --use-flash-attn = flash.
    The local layer spec runs megatron-core's own attention whatever it says."""
    cross_entropy_loss_fusion: bool
    """Fused vocab-parallel cross entropy (--cross-entropy-loss-fusion); CUDA only."""
    cross_entropy_fusion_impl: str
    """Its implementation: "native" (megatron-core) or "te" (--cross-entropy-fusion-impl)."""
    recompute_granularity: str | None
    """Activation recomputation: "full" or "selective" (--recompute-granularity;
    --recompute-activations = selective); None: off."""
    recompute_method: str | None
    """With full recomputation: "uniform" or "block" (--recompute-method)."""
    recompute_num_layers: int | None
    """With full recomputation: layers per recomputed chunk (uniform) or recomputed layers per
    pipeline stage (block) (--recompute-num-layers)."""
    calculate_per_token_loss: bool
    """The loss and gradient of an iteration are divided by its loss tokens (all of the global
    batch's unmasked tokens), not averaged per microbatch (--calculate-per-token-loss)."""
    moe: MoEConfig | None
    """Mixture-of-experts layers (--num-experts and the --moe-* flags); None: a dense model."""


@dataclass(frozen=True)
class OptimConfig:
    """Adam and its learning-rate schedule (OptimizerConfig + OptimizerParamScheduler).

    Megatron's scheduler counts steps in samples and is stepped by the global batch size once per
    iteration; so does this config: an iteration-based schedule (--lr-decay-iters, ...) is
    converted to samples (x GBS) exactly as Megatron-LM does, a sample-based one
    (--lr-decay-samples, ...) is taken as given.
    """

    lr: float
    """Peak learning rate (--lr); required."""
    min_lr: float
    """Learning rate floor (--min-lr)."""
    lr_decay_style: str
    """constant | linear (default) | cosine | inverse-square-root | WSD (--lr-decay-style)."""
    lr_decay_samples: int
    """Samples over which the learning rate decays (--lr-decay-samples, or --lr-decay-iters x
    GBS; default: the whole run)."""
    lr_warmup_samples: float
    """Linear warmup length in samples (--lr-warmup-samples, or --lr-warmup-iters x GBS, or
    --lr-warmup-fraction x lr_decay_samples, which may be fractional as Megatron allows)."""
    lr_warmup_init: float
    """Learning rate at the start of warmup (--lr-warmup-init)."""
    lr_wsd_decay_style: str
    """Annealing shape of the WSD schedule (--lr-wsd-decay-style, default exponential)."""
    lr_wsd_decay_samples: int | None
    """Samples of WSD's annealing phase (--lr-wsd-decay-samples, or --lr-wsd-decay-iters x GBS);
    required for WSD."""
    weight_decay: float
    """Decoupled weight decay (--weight-decay)."""
    start_weight_decay: float
    """Weight decay at the start of the run (--start-weight-decay, default --weight-decay)."""
    end_weight_decay: float
    """Weight decay at the end of the run (--end-weight-decay, default --weight-decay)."""
    weight_decay_incr_style: str
    """How it moves from start to end: constant (default) | linear | cosine
    (--weight-decay-incr-style)."""
    clip_grad: float
    """Global L2 gradient-norm clip (--clip-grad)."""
    adam_beta1: float
    """Adam beta1 (--adam-beta1)."""
    adam_beta2: float
    """Adam beta2 (--adam-beta2)."""
    adam_eps: float
    """Adam epsilon (--adam-eps)."""
    decoupled_lr: float | None
    """Peak learning rate of the input embedding and output layer (--decoupled-lr); None: --lr."""
    decoupled_min_lr: float | None
    """Their learning-rate floor (--decoupled-min-lr); None: --min-lr."""
    override_scheduler: bool
    """On --load, the scheduler's values come from the arguments (--override-opt-param-scheduler).
    With neither this nor `use_checkpoint_scheduler` (Megatron-LM's default) a checkpoint whose
    values differ from the arguments' stops the load."""
    use_checkpoint_scheduler: bool
    """On --load, from the checkpoint (--use-checkpoint-opt-param-scheduler)."""


@dataclass(frozen=True)
class PrecisionConfig:
    """Parameter precision and loss scaling (--fp16 / --bf16; fp32 when neither)."""

    fp16: bool
    """Parameters and compute in float16, with loss scaling (--fp16)."""
    bf16: bool
    """Parameters and compute in bfloat16 (--bf16)."""
    loss_scale: float | None
    """Static loss scale for fp16 (--loss-scale); None: dynamic scaling."""
    initial_loss_scale: float
    """Initial dynamic loss scale (--initial-loss-scale)."""
    min_loss_scale: float
    """Smallest dynamic loss scale (--min-loss-scale)."""
    loss_scale_window: float
    """Iterations between dynamic loss-scale raises (--loss-scale-window)."""
    hysteresis: int
    """Dynamic loss-scale hysteresis (--hysteresis)."""
    accumulate_allreduce_grads_in_fp32: bool
    """Gradient buffers and their reduction in fp32 (--accumulate-allreduce-grads-in-fp32);
    on with --bf16 unless --grad-reduce-in-bf16, as Megatron-LM sets it."""
    attention_softmax_in_fp32: bool
    """Attention masking and softmax in fp32 (--attention-softmax-in-fp32, default off as in
    Megatron-LM; megatron-core's own default is on)."""
    check_for_nan_in_loss_and_grad: bool
    """Megatron-LM's check of every microbatch loss and every gradient bucket's norm for NaN
    and inf before the data-parallel reduction (off with --no-check-for-nan-in-loss-and-grad,
    and, as Megatron-LM sets it, with fp16's dynamic loss scaling, whose overflows are inf by
    design). Under --recover a NaN loss ends the job as a program error, and a replica whose
    gradient alone is not finite leaves as a device fault does (docs/failures.md)."""

    @property
    def params_dtype(self):
        """torch dtype of the parameters: float16, bfloat16 or float32."""
        import torch

        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32

    def describe(self) -> str:
        """One start-up line: parameter, gradient and loss-scaling precision."""
        params = "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32"
        grads = "fp32" if self.accumulate_allreduce_grads_in_fp32 or params == "fp32" else params
        line = f"{params} parameters (fp32 main copy in the optimizer)" if params != "fp32" \
            else "fp32 parameters"
        line += f", gradients accumulated and reduced in {grads}"
        if self.fp16:
            # megatron-core scales dynamically unless --loss-scale is a positive number.
            line += (f", static loss scale {self.loss_scale:g}" if self.loss_scale
                     else f", dynamic loss scale from {self.initial_loss_scale:g}")
        return line


@dataclass(frozen=True)
class ParallelConfig:
    """How the world is cut into TP x PP model-parallel groups, data-parallel ranks and replicas.

    A replica is the unit of survival: the TP x PP ranks of one data-parallel rank, or, with
    distributed-optimizer instances, one instance = dp_ranks_per_replica data-parallel ranks
    (optimizer state is sharded inside it and all-reduced across replicas).
    """

    world_size: int
    """Ranks at launch (from MPI, not an argument)."""
    tensor_model_parallel_size: int
    """TP degree (--tensor-model-parallel-size)."""
    pipeline_model_parallel_size: int
    """PP degree (--pipeline-model-parallel-size)."""
    use_distributed_optimizer: bool
    """Shard optimizer state (--use-distributed-optimizer); with --recover only within a replica."""
    num_distributed_optimizer_instances: int
    """Optimizer-state copies across the data-parallel group
    (--num-distributed-optimizer-instances); each instance shards the state over
    data_parallel_size // this ranks."""
    overlap_grad_reduce: bool
    """Overlap the gradient reduction with the backward pass (--overlap-grad-reduce)."""
    overlap_param_gather: bool
    """Overlap the distributed optimizer's parameter all-gather with the next forward pass: each
    bucket group's gather is waited for in the forward pre-hook of its first module
    (--overlap-param-gather; needs the distributed optimizer and --overlap-grad-reduce)."""
    ddp_bucket_size: int | None
    """Max parameters per gradient bucket (--ddp-bucket-size); None: megatron-core's default,
    max(40M, 1M x dp)."""
    sequence_parallel: bool
    """Sequence parallelism inside TP groups (--sequence-parallel); off when TP == 1."""
    use_cpu_initialization: bool
    """Initialize full weights on the CPU and scatter them (--use-cpu-initialization)."""
    gradient_accumulation_fusion: bool
    """Fuse weight-gradient accumulation into the GEMM (Megatron's default on CUDA, where it
    needs Apex's kernel; off on CPU, where the kernel does not exist).
    --no-gradient-accumulation-fusion turns it off."""
    distributed_backend: str
    """The backend of megatron's own (training) groups on CUDA (--distributed-backend, nccl or
    gloo); on the CPU they are gloo (groups.py)."""
    ranks_per_device: int
    """Consecutive node-local ranks bound to one device (--recover-ranks-per-device)."""
    virtual_pipeline_stages: int | None
    """Model chunks per pipeline rank of the interleaved schedule
    (--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank);
    None: the plain 1F1B schedule."""
    microbatch_group_size: int | None
    """Contiguous microbatches per virtual stage in the interleaved schedule
    (--microbatch-group-size-per-virtual-pipeline-stage); None: the pipeline size."""
    overlap_p2p_comm: bool
    """The interleaved schedule's pipeline sends and receives overlap compute (Megatron-LM's
    default; --no-overlap-p2p-communication batches them instead)."""
    overlap_p2p_comm_warmup_flush: bool
    """Overlap them in the warm-up and flush phases too
    (--overlap-p2p-communication-warmup-flush)."""
    align_param_gather: bool
    """With --overlap-param-gather and model chunks, the interleaved schedule dispatches each
    later chunk's parameter all-gathers itself (Megatron-LM's default; --no-align-param-gather:
    each chunk's forward pre-hook does). Under --recover every chunk's are dispatched after
    the optimizer step instead."""
    expert_model_parallel_size: int
    """Ranks that split each MoE layer's experts (--expert-model-parallel-size); under
    --recover they lie inside one replica."""

    @property
    def model_chunks(self) -> int:
        """The model chunks a rank holds: its virtual pipeline stages, or 1."""
        return self.virtual_pipeline_stages or 1

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model: TP x PP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks: world_size // (TP x PP)."""
        return self.world_size // self.model_parallel_size

    @property
    def num_replicas(self) -> int:
        """Replicas at launch (W_init): the distributed-optimizer instances when the optimizer is
        distributed, else the data-parallel ranks."""
        if self.use_distributed_optimizer:
            return self.num_distributed_optimizer_instances
        return self.data_parallel_size

    @property
    def dp_ranks_per_replica(self) -> int:
        """Data-parallel ranks inside one replica (1 unless distributed-optimizer instances)."""
        return self.data_parallel_size // self.num_replicas

    @property
    def ranks_per_replica(self) -> int:
        """Processes in one replica: dp_ranks_per_replica x TP x PP."""
        return self.dp_ranks_per_replica * self.model_parallel_size


@dataclass(frozen=True)
class DataConfig:
    """Where samples and tokens come from (megatron-core GPTDataset + tokenizer)."""

    blend: tuple | None
    """megatron's blend of --data-path (or of --data-args-path's file): (the indexed datasets'
    prefixes, PREFIX.bin / PREFIX.idx, and their weights or None), as megatron-core's
    get_blend_from_list reads the list; None with --mock-data or per-split data."""
    blend_per_split: tuple | None
    """(train, valid, test) blends of --train-data-path, --valid-data-path, --test-data-path or
    --per-split-data-args-path, each None where not given; each split's blend is used whole
    (split None). None without them."""
    mock_data: bool
    """Synthetic samples from megatron-core's MockGPTDataset (--mock-data)."""
    split: str | None
    """Train/valid/test proportions (--split); Megatron's legacy "969, 30, 1" when --data-path
    is given without it; None with --mock-data (megatron-core then splits evenly)."""
    data_cache_path: str | None
    """Directory for the dataset's cached index files (--data-cache-path)."""
    reset_position_ids: bool
    """Restart position ids after each end-of-document token (--reset-position-ids)."""
    reset_attention_mask: bool
    """Block attention across end-of-document tokens (--reset-attention-mask)."""
    eod_mask_loss: bool
    """Exclude end-of-document tokens from the loss (--eod-mask-loss)."""
    create_attention_mask: bool
    """A dense causal mask in every batch (Megatron-LM's default); off with
    --no-create-attention-mask-in-dataloader (attention builds the causal mask itself). Always on
    with --reset-attention-mask, whose mask is not the plain causal one."""
    mmap_bin_files: bool
    """Read the .bin files through a memory map (Megatron-LM's default); off with
    --no-mmap-bin-files (file reads per sample)."""
    tokenizer_type: str
    """One of `tokenizer.TOKENIZER_TYPES` (--tokenizer-type); inferred as GPT2BPETokenizer from
    --vocab-file + --merge-file, NullTokenizer from --vocab-size alone."""
    vocab_file: str | None
    """GPT-2 vocab.json (--vocab-file)."""
    merge_file: str | None
    """GPT-2 merges.txt (--merge-file)."""
    tokenizer_model: str | None
    """A local HuggingFace tokenizer directory, SentencePiece model or tiktoken vocabulary
    (--tokenizer-model)."""
    vocab_size: int | None
    """Vocabulary size for NullTokenizer and TikTokenizer (--vocab-size)."""
    tiktoken_pattern: str | None
    """TikTokenizer's pre-tokenization regex, v1 or v2 (--tiktoken-pattern); None otherwise."""
    tiktoken_num_special_tokens: int
    """Ids TikTokenizer reserves for special tokens (--tiktoken-num-special-tokens)."""
    tokenizer_special_tokens: tuple | None
    """TikTokenizer's special tokens (--tokenizer-special-tokens); None: megatron-core's."""
    null_tokenizer_eod_id: int | None
    """NullTokenizer's end-of-document id (--null-tokenizer-eod-id); None: vocab_size - 1."""
    null_tokenizer_pad_id: int | None
    """NullTokenizer's pad id (--null-tokenizer-pad-id); None: -1, no pad token."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints (written by the lowest live replica)."""

    save: str | None
    """Directory to save checkpoints to (--save)."""
    load: str | None
    """Directory to resume from (--load)."""
    save_interval: int | None
    """Iterations between saves (--save-interval); required with --save, as in Megatron-LM."""
    ckpt_format: str = "torch_dist"
    """--ckpt-format: "torch_dist" (megatron-core distributed checkpoints, both modes) or "torch"
    (--recover only: Megatron-LM's per-rank torch files)."""
    load_optim: bool = True
    """False with --no-load-optim: the optimizer and scheduler start fresh (loading.py has the
    meanings of these load flags)."""
    load_rng: bool = True
    """False with --no-load-rng: the generators are not loaded."""
    finetune: bool = False
    """--finetune: load the model only and start at iteration 1."""
    pretrained_checkpoint: str | None = None
    """--pretrained-checkpoint: fine-tune from this directory when --load holds no checkpoint."""
    ckpt_step: int | None = None
    """--ckpt-step: load this iteration instead of the tracker's."""
    exit_on_missing_checkpoint: bool = False
    """--exit-on-missing-checkpoint: stop when --load holds no checkpoint."""
    async_save: bool = False
    """--async-save: a save returns once its tensors are copied to host memory and is written
    in the background (dist_checkpoint.AsyncSaves)."""

    def due(self, iteration: int, train_iters: int) -> bool:
        """As Megatron-LM: a save after every --save-interval iterations and at the end (an
        --exit-* stop saves too, if this did not)."""
        return bool(self.save) and (iteration % self.save_interval == 0
                                    or iteration == train_iters)


@dataclass(frozen=True)
class RecoverConfig:
    """In-step recovery (our flags). With enabled False the job is stock Megatron."""

    enabled: bool
    """--recover: survive replica failures in-step."""
    policy: str
    """--recover-policy: "static" (default; the batch stays B) or "adaptive" (drop-and-go)."""
    mode: str
    """--recover-mode: "exact" (default; failure-free microbatch ids) or "reserve" (the paper's)."""
    failure_schedule: Path | None
    """--recover-failure-schedule: YAML of faults to inject (tests, demo)."""
    log: Path | None
    """--recover-log: per-iteration JSONL records."""
    hang_timeout_s: float
    """--recover-hang-timeout: seconds after which a frozen rank is declared failed (0: off)."""
    restore: bool
    """False with --recover-no-restore (a diagnostic negative control)."""
    cuda_aware_mpi: bool
    """--recover-cuda-aware-mpi: the cross-replica group hands CUDA buffers to MPI directly
    (refused at start-up unless the MPI reports CUDA support) instead of staging them."""
    data_plane: str
    """--recover-data-plane: "torch" (a reconfigurable gloo or NCCL group carries the
    cross-replica bytes) or "mpi" (the ulfm group does); `collective/torch_plane.py`."""
    program_errors: str
    """--recover-program-errors: "abort" (default; a program error ends the job) or "survive"
    (it takes only its rank down); see megatron_recover/errors.py."""
    cross_replica_backend: str
    """--cross-replica-backend: the data-parallel group's backend ("ulfm" with --recover)."""
    standby_replicas: int
    """--recover-standby-replicas: replicas started beside the training ones (the last MPI
    ranks; not in the world size) that wait, then replace lost replicas at an iteration
    boundary."""
    snapshot_interval: int
    """--recover-snapshot-interval: iterations between in-memory snapshots (0: none)."""
    snapshot_dir: Path | None
    """--recover-snapshot-dir, or the launcher's per-job default: where a node keeps them."""
    sdc_check_rate: float
    """--recover-sdc-check-rate: the probability that a replica's first pass is verified by a
    second replica in an iteration (0: off); `recovery/verification.py`."""
    sdc_tolerance: float
    """--recover-sdc-tolerance: relative fingerprint tolerance (0: bitwise)."""
    nonfinite_rerun: str
    """--recover-nonfinite-rerun: off, evict or keep (`recovery/rerun.py`)."""
    straggler_threshold: float
    """--recover-straggler-threshold: how much slower than the others' median a replica must be
    for work to move away from it (0: off); `policy/speed.py`."""
    straggler_window: int
    """--recover-straggler-window: consecutive iterations before work moves, moves back, or a
    replica is evicted."""
    evict_slower_than: float
    """--recover-evict-slower-than: the factor past which a slow replica is evicted (0: never)."""


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation on the validation split of --split, as Megatron-LM's training loop runs it."""

    interval: int | None
    """--eval-interval: iterations between evaluations; None (absent or 0, Megatron-LM's
    default, core_v0.19.0 as core_v0.16.1): only the evaluation at the end of training."""
    iters: int
    """--eval-iters: global batches per evaluation; 0: no evaluation."""

    def due(self, iteration: int) -> bool:
        """Whether an evaluation follows `iteration` (the one at the end of training aside)."""
        return bool(self.iters and self.interval and iteration % self.interval == 0)

    def evaluations(self, train_iters: int) -> int:
        """How many evaluations of the validation split a run of train_iters iterations makes
        (Megatron-LM sizes the split for them): one per interval, and one at the end."""
        if not self.iters:
            return 0
        return (train_iters // self.interval if self.interval else 0) + 1


@dataclass(frozen=True)
class LoggingConfig:
    """Console lines, TensorBoard and Weights & Biases (written by the lowest live rank)."""

    log_interval: int
    """--log-interval: iterations between console lines; values averaged over it."""
    log_throughput: bool
    """--log-throughput: TFLOP/s per rank in the iteration line (Megatron-LM's model FLOPs)."""
    tensorboard_dir: Path | None
    """--tensorboard-dir: where the TensorBoard event files go; None: none."""
    tensorboard_log_interval: int
    """--tensorboard-log-interval: iterations between TensorBoard values."""
    tensorboard_queue_size: int
    """--tensorboard-queue-size: values the writer holds before it flushes."""
    log_loss_scale: bool
    """False with --no-log-loss-scale-to-tensorboard."""
    log_validation_ppl: bool
    """--log-validation-ppl-to-tensorboard: also the validation perplexity."""
    log_world_size: bool
    """--log-world-size-to-tensorboard: the live ranks."""
    log_timers: bool
    """--log-timers-to-tensorboard: iteration time (and throughput with --log-throughput)."""
    wandb_project: str | None
    """--wandb-project: also log to Weights & Biases (needs the `wandb` package)."""
    wandb_exp_name: str
    """--wandb-exp-name: the run's name there."""
    wandb_save_dir: str
    """--wandb-save-dir: its local files (default: beside --save)."""
    wandb_entity: str
    """--wandb-entity: the team or user."""


@dataclass(frozen=True)
class ExitConfig:
    """Leaving before --train-iters (Megatron-LM's exit flags): every rank stops after the same
    iteration, with a checkpoint first when --save is given."""

    duration_mins: float | None
    """--exit-duration-in-mins: stop once a rank has run this long (since its start)."""
    interval: int | None
    """--exit-interval: stop after the first iteration that is a multiple of it."""
    signal_handler: bool
    """--exit-signal-handler: stop after the iteration in which a rank received --exit-signal."""
    signal: str
    """--exit-signal: the signal --exit-signal-handler catches (default SIGTERM)."""

    @property
    def agreed(self) -> bool:
        """Whether the ranks must agree every iteration (a clock or a signal decides)."""
        return self.duration_mins is not None or self.signal_handler


@dataclass(frozen=True)
class TrainConfig:
    """Everything `pretrain_gpt_recover.py` needs, validated; one per rank, equal on all ranks."""

    model: ModelConfig
    optim: OptimConfig
    precision: PrecisionConfig
    parallel: ParallelConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    recover: RecoverConfig
    micro_batch_size: int
    """Samples per microbatch on one data-parallel rank (--micro-batch-size)."""
    global_batch_size: int
    """Samples per iteration, all ranks together (--global-batch-size, default mbs x dp); with
    --step-batch-size-schedule, the last step's size (B; the earlier steps are smaller)."""
    train_iters: int
    """Iterations to train, counted from 1 (--train-iters, or Megatron-LM's update_train_iters
    count for --train-samples: its whole global batches, or with a batch-size schedule the
    iterations that start before --train-samples are consumed)."""
    train_samples: int
    """The training split's size in samples: --train-samples when training is sample-based
    (Megatron-LM builds the split with that many), train_iters x GBS otherwise."""
    seed: int
    """Base random seed (--seed)."""
    logging: LoggingConfig
    evaluation: EvalConfig
    exit: ExitConfig
    step_batch_size_schedule: str | None
    """--step-batch-size-schedule "THRESHOLD:BS ..." (sample-based training; thresholds in
    tokens of --seq-length, as Megatron-LM passes them), or None."""
    notices: tuple[str, ...] = ()
    """Start-up lines about the arguments: the no-effect flags given (with the reason), and
    choices made for the user (layer spec, fallbacks); rank 0 prints them."""

    @property
    def log_interval(self) -> int:
        """Iterations between console lines (--log-interval)."""
        return self.logging.log_interval

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks at launch."""
        return self.parallel.data_parallel_size

    @property
    def num_replicas(self) -> int:
        """Replicas at launch (W_init)."""
        return self.parallel.num_replicas

    @property
    def dp_ranks_per_replica(self) -> int:
        """Data-parallel ranks in one replica."""
        return self.parallel.dp_ranks_per_replica

    @property
    def b(self) -> int:
        """B: microbatches per iteration over all data-parallel ranks, GBS // mbs (the last
        step of a batch-size schedule); a microbatch id names one data-parallel rank's
        micro-batch (docs/design.md, "Exact semantics")."""
        return self.global_batch_size // self.micro_batch_size

    @property
    def global_batches(self) -> GlobalBatches:
        """The global batch of every iteration: its size (smaller before a batch-size
        schedule's last step) and where its samples start."""
        if self.step_batch_size_schedule is None:
            return GlobalBatches.of(self.global_batch_size)
        return GlobalBatches.of_schedule(self.step_batch_size_schedule, self.model.seq_length)

    def b_at(self, iteration: int) -> int:
        """The global microbatch count of `iteration`: B, or less before a batch-size
        schedule's last step."""
        return self.global_batches.size(iteration) // self.micro_batch_size

    @property
    def main_samples(self) -> int:
        """Where the training split's main stream ends (the reserve stream starts there):
        --train-samples, or past it what the last iteration of a batch-size schedule reads
        beyond it (Megatron-LM's update_train_iters runs that iteration whole)."""
        return max(self.train_samples, self.global_batches.consumed_after(self.train_iters))

    @property
    def eval_global_batch_size(self) -> int:
        """Samples per evaluation iteration: Megatron-LM's args.global_batch_size, which its
        evaluation reads and its checkpoints record: --global-batch-size, or with
        --step-batch-size-schedule (which excludes it) its default, mbs x dp."""
        if self.step_batch_size_schedule is None:
            return self.global_batch_size
        return self.micro_batch_size * self.data_parallel_size

    @property
    def num_microbatches_per_dp_rank(self) -> int:
        """Megatron's num_microbatches at launch: GBS // (mbs x dp)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def num_microbatches_per_replica(self) -> int:
        """G_init: microbatch ids one replica contributes per iteration at launch (B // W_init)."""
        return self.b // self.num_replicas
