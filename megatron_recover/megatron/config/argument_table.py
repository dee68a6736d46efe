"""The status of every Megatron-LM argument under `pretrain_gpt_recover.py`.

A user's Megatron job script is our interface, so no Megatron argument is silently ignored. Each
one has exactly one status:

  implemented     parsed by `arguments.build_parser` with Megatron-LM's name, meaning and default
                  (some are refused for particular values or on particular hardware: the note
                  says when, and the start-up validation says why);
  refused         stops the job at start-up with the reason and what to use instead; a few accept
                  the one value that equals what we do (`--context-parallel-size 1`);
  no effect here  accepted, changes nothing on this implementation, and printed at start-up with
                  the reason (logging sinks, NCCL tuning, switches for kernels we never enable).

The refused and no-effect entries live here, grouped by reason; the implemented ones are the
parser's. `docs/arguments.md` is generated from this module (`scripts/argument_table.py`), and a
test checks it against the code and every name of Megatron-LM's parser at core_v0.19.0.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

IMPLEMENTED = "implemented"
REFUSED = "refused"
NO_EFFECT = "no effect here"
OURS = "megatron-recover"  # our own flags (--recover*, ...), not Megatron-LM's


@dataclass(frozen=True)
class Entry:
    status: str
    reason: str
    """refused: why, and what to use instead; no effect: why; implemented: when it is refused
    (a value, a device, a missing package), or empty."""
    nargs: int | str = 0
    """No-effect flags: the values argparse takes after the flag (0, 1 or "*"), as Megatron-LM's."""
    accepts: tuple[str, ...] = ()
    """Refused flags: the values that ask for what we do anyway, accepted without a word."""


# ---------------------------------------------------------------------------------------------
# No effect here. A name ending in ":1" takes one value, ":*" any number; otherwise a switch.
# ---------------------------------------------------------------------------------------------

_NO_EFFECT_GROUPS = (
    ("a metric or timer that megatron-recover does not compute (the iteration line, TensorBoard "
     "and --recover-log carry the loss, learning rate, grad norm, loss scale, iteration time, "
     "live replicas and failures); training is unchanged",
     "--log-memory-to-tensorboard --log-params-norm "
     "--log-num-zeros-in-grad --timing-log-level:1 --timing-log-option:1 "
     "--no-barrier-with-level-1-timing --log-device-memory-used --log-energy "
     "--log-max-attention-logit --log-memory-interval:1 --log-progress --logging-level:1 "
     "--config-logger-dir:1"),
    ("no data-loader worker processes run here (the microbatches are read in the training "
     "process), so there is no worker to give a signal handler",
     "--exit-signal-handler-for-dataloader"),
    ("NVIDIA's one-logger telemetry is not used", "--no-one-logger --one-logger-project:1 "
     "--one-logger-run-name:1 --one-logger-async --app-tag-run-name:1 --app-tag-run-version:1"),
    ("Megatron-LM's straggler detector and GPU sniff test (they report) are not used: under "
     "--recover, --recover-straggler-threshold measures every replica's speed and moves work "
     "away from a slow one, --recover-evict-slower-than evicts it; a frozen rank is detected by "
     "--recover-hang-timeout",
     "--log-straggler --disable-straggler-on-startup --straggler-ctrlr-port:1 "
     "--straggler-minmax-count:1 --gpu-sniff-test-interval:1"),
    ("rendezvous, ranks and timeouts come from MPI (mpirun); a hung peer is bounded by "
     "--recover-hang-timeout", "--distributed-timeout-minutes:1 "
     "--distributed-timeout-seconds-after-init:1 --local-rank:1"),
    ("the fusion it switches off is never enabled here: the bias-GeLU, bias-SwiGLU and "
     "bias-dropout fusions (megatron-core's torch.compile functions) and the Apex or compiled-"
     "extension kernels of the others are off in every run, where Megatron-LM enables them by "
     "default on a GPU", "--no-masked-softmax-fusion --no-bias-dropout-fusion "
     "--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm "
     "--disable-jit-fuser --no-gradient-reduce-div-fusion"),
    ("the overlap it switches off is never enabled here (tensor-parallel communication overlap "
     "needs Transformer Engine's userbuffers on CUDA)", "--no-tp-comm-bulk-dgrad "
     "--no-tp-comm-bulk-wgrad --no-tp-comm-overlap-ag --no-tp-comm-overlap-rs "
     "--no-tp-comm-split-ag --no-tp-comm-split-rs --disable-tp-comm-bulk-dgrad "
     "--disable-tp-comm-bulk-wgrad --disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs "
     "--disable-tp-comm-split-ag --disable-tp-comm-split-rs"),
    ("memory and scheduling knobs of the data loader and the garbage collector; the samples "
     "and their order do not depend on them", "--num-workers:1 "
     "--dataloader-defer-npy-index-mmap --dataloader-fast-cache-load "
     "--num-dataset-builder-threads:1 --manual-gc --manual-gc-interval:1 --no-manual-gc-eval "
     "--disable-manual-gc-eval --empty-unused-memory-level:1 --train-sync-interval:1 "
     "--no-clone-scatter-output-in-embedding --disable-clone-scatter-output-in-embedding"),
    ("NCCL tuning; the cross-replica reduction runs over MPI (ulfm) and megatron-recover passes "
     "no NCCL communicator options", "--nccl-communicator-config-path:1 --use-sharp "
     "--sharp-enabled-group:1 --high-priority-stream-groups:* "
     "--ddp-pad-buckets-for-high-nccl-busbw --disable-symmetric-registration"),
    ("NCCL flight-recorder dumps (debugging output, written only when a dump path is set) are "
     "not configured by megatron-recover: set PyTorch's TORCH_NCCL_* and TORCH_FR_* environment "
     "variables instead; training is unchanged", "--flight-recorder-dump-path:1 "
     "--flight-recorder-include-stack-trace --flight-recorder-trace-buffer-size:1 "
     "--disable-flight-recorder-dump-on-timeout --no-flight-recorder-dump-on-timeout "
     "--disable-flight-recorder-extra-dump-on-exec --no-flight-recorder-extra-dump-on-exec "
     "--disable-flight-recorder-include-only-active --no-flight-recorder-include-only-active"),
    ("with --overlap-grad-reduce every pipeline stage here already starts its gradient "
     "reductions as its buckets fill, which is what this flag selects",
     "--no-align-grad-reduce --disable-align-grad-reduce"),
    ("only read with CPU optimizer offload, which is refused", "--no-pin-cpu-grads "
     "--no-pin-cpu-params"),
    ("only read with --profile, which is refused", "--profile-step-start:1 --profile-step-end:1 "
     "--profile-ranks:* --nvtx-ranges --record-shapes --pytorch-profiler-collect-shapes "
     "--pytorch-profiler-collect-callstack --pytorch-profiler-collect-chakra"),
    ("MoE router decision traces are not written (a logging sink); training is unchanged",
     "--moe-routing-trace-path:1 --moe-routing-trace-capture-hidden-states "
     "--moe-routing-trace-capture-logits --moe-routing-trace-dump-weights "
     "--moe-routing-trace-max-training-iters:1"),
    ("megatron-core's own GPT model is the only model here (Megatron-LM's default)",
     "--use-mcore-models"),
    ("a CUDA matmul setting; with bf16 on CPU there is no reduced-precision reduction to turn off",
     "--disable-bf16-reduced-precision-matmul"),
    ("the multi-storage client is not used: every path is a local file", "--disable-msc"),
    ("deprecated in Megatron-LM: megatron-core's GPT model takes its positions from "
     "--position-embedding-type, and only Megatron-LM's legacy models read this flag",
     "--no-position-embedding"),
    ("checkpoint reads and writes are spread over the ranks already (each rank its own shard)",
     "--ckpt-fully-parallel-load --ckpt-fully-parallel-save"),
    ("which ranks share the reading and writing of a torch_dist checkpoint, and how they "
     "exchange it; the checkpoint read or written is the same (a stock save here is spread over "
     "the data-parallel group, Megatron-LM's default)",
     "--ckpt-fully-parallel-load-exchange-algo:1 --ckpt-fully-parallel-load-process-group:1 "
     "--ckpt-fully-parallel-save-process-group:1"),
    ("--async-save here runs megatron-core's checkpoint writer in megatron-recover's own forked "
     "process: Megatron-LM's choice of asynchronous implementation (nvrx or mcore), its writer "
     "threads, the writer's CPU and I/O priorities and its shared-memory staging do not apply; "
     "the checkpoint written is the same", "--async-strategy:1 --async-ckpt-cpu-priority:1 "
     "--async-ckpt-io-priority:1 --async-ckpt-use-cpu-shm --dist-ckpt-workers:1"),
    ("only read when loading fp8/fp4 (quantized) parameters, which are refused",
     "--disable-stream-ckpt-dequant --no-stream-ckpt-dequant"),
)

# ---------------------------------------------------------------------------------------------
# Refused. "what instead" is part of every reason.
# ---------------------------------------------------------------------------------------------

_GPU = "needs a CUDA device"
_REFUSED_GROUPS = (
    ("activation recomputation of MoE layers alone is not supported: use "
     "--recompute-activations (selective) or drop it", "--moe-layer-recompute"),
    ("the router's expert bias (and quantile balancing's) is updated from the token counts of "
     "the ranks that ran each microbatch, which a failure changes; use --moe-aux-loss-coeff for "
     "load balancing", "--moe-router-enable-expert-bias --moe-router-bias-update-rate "
     "--moe-router-quantile-balancing-ema"),
    ("the input jitter is not supported; drop it", "--moe-input-jitter-eps"),
    ("DeepEP, HybridEP and NCCL EP (the flex dispatcher's backends) and the expert-parallel "
     "communication overlap are not supported: use --moe-token-dispatcher-type alltoall",
     "--moe-enable-deepep --moe-deepep-num-sms "
     "--moe-hybridep-num-sms --moe-flex-dispatcher-backend --overlap-moe-expert-parallel-comm "
     "--ep-overlap-early-attn-memory-release --moe-flex-dispatcher-num-sms "
     "--moe-expert-rank-capacity-factor --moe-hybridep-num-blocks-permute "
     "--moe-hybridep-num-blocks-unpermute --moe-hybridep-num-sms-preprocessing "
     "--moe-hybridep-pad-uneven-dispatch-inputs --moe-permute-fusion-into-hybridep "
     "--moe-ncclep-static-shape --moe-ncclep-zero-copy --high-priority-a2a-comm-stream"),
    ("the shared expert's gate and its overlap with the dispatch are not supported: drop them "
     "(a shared expert runs without a gate, after the dispatch)",
     "--moe-shared-expert-gate --moe-shared-expert-overlap"),
    ("upcycling a dense checkpoint into experts is not supported: train the MoE model from "
     "scratch or --load an MoE checkpoint", "--moe-use-upcycling --moe-upcycling-granularity"),
    ("only with fp8 or fp4, which are refused", "--moe-router-padding-for-fp8 "
     "--moe-router-padding-for-quantization"),
    ("benchmark-only routing, latent experts, routing replay, the paged activation stash, "
     "block-interleaved GLU layouts, single grouped expert parameters and CUDA graphs for "
     "inference are not supported; drop them", "--moe-router-force-load-balancing "
     "--moe-router-force-biased --moe-latent-size --moe-enable-routing-replay "
     "--moe-pad-experts-for-cuda-graph-inference --moe-apply-probs-on-input --moe-paged-stash "
     "--moe-paged-stash-buffer-size-factor-cpu --moe-paged-stash-buffer-size-factor-cuda "
     "--moe-paged-stash-page-size --moe-mlp-glu-interleave-size "
     "--moe-shared-expert-glu-interleave-size --moe-single-grouped-bias "
     "--moe-single-grouped-weight"),
    ("context parallelism splits a microbatch's sequence over ranks that a replica failure "
     "would cut apart, and megatron-core's local attention needs CP = 1; use "
     "--context-parallel-size 1 (the default, accepted)", "--context-parallel-size=1 "
     "--cp-comm-type --hierarchical-context-parallel-sizes --hybrid-context-parallel "
     "--max-seqlen-per-dp-cp-rank"),
    ("uneven pipeline splits are not supported: each stage holds --num-layers / PP layers",
     "--pipeline-model-parallel-layout --decoder-first-pipeline-num-layers "
     "--decoder-last-pipeline-num-layers --account-for-embedding-in-pipeline-split "
     "--account-for-loss-in-pipeline-split"),
    (f"fp8/fp4 training {_GPU} with Transformer Engine's quantized GEMMs, and megatron-recover "
     "does not drive Transformer Engine's fp8 recipes; train in --bf16",
     "--fp8-format --fp8-recipe --fp8-margin --fp8-interval --fp8-amax-history-len "
     "--fp8-amax-compute-algo --fp8-param-gather --fp8-quantizer-factory --disable-fp8-wgrad "
     "--no-fp8-wgrad --fp4-format --fp4-recipe --fp4-param-gather --fp4-quantizer-factory "
     "--first-last-layers-bf16 --num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16 "
     "--keep-fp8-transpose-cache --reuse-grad-buf-for-mxfp8-param-ag --te-precision-config-file "
     "--fp8-output-proj"),
    (f"tensor-parallel communication overlap {_GPU} and Transformer Engine's userbuffers; drop it",
     "--tp-comm-overlap --tp-comm-overlap-cfg --tp-comm-overlap-rs-dgrad "
     "--tp-comm-bootstrap-backend --use-nccl-ub --symmetric-ar-type"),
    (f"CUDA graphs {_GPU}, and a captured graph cannot follow a schedule that changes when a "
     "replica fails; drop it", "--enable-cuda-graph --cuda-graph-impl --cuda-graph-warmup-steps "
     "--external-cuda-graph --cuda-graph-scope --cuda-graph-modules --optimizer-cuda-graph"),
    (f"the CUDA profiler (nsys) {_GPU}; profile with py-spy or torch.profiler around "
     "pretrain_gpt_recover.py instead", "--profile --use-pytorch-profiler "
     "--record-memory-history --memory-snapshot-path"),
    ("activation and optimizer offloading to host memory is not supported: it assumes a GPU "
     "whose memory it relieves; drop it", "--cpu-offloading-num-layers "
     "--fine-grained-activation-offloading --offload-modules --min-offloaded-tensor-size "
     "--optimizer-cpu-offload --optimizer-offload-fraction --overlap-cpu-optimizer-d2h-h2d "
     "--use-torch-optimizer-for-cpu-offload --activation-offload-fraction "
     "--cpu-offloading-retain-pinned-cpu-buffers --delay-offload-until-cuda-graph "
     "--delta-offload-bytes-across-pp-ranks --fine-grained-offloading-max-inflight-offloads"),
    ("FSDP shards parameters over the data-parallel ranks, so a dead replica would take its "
     "shard with it; use --use-distributed-optimizer with --num-distributed-optimizer-instances "
     "(optimizer state sharded within each replica)", "--use-megatron-fsdp --use-torch-fsdp2 "
     "--data-parallel-sharding-strategy --outer-dp-sharding-strategy "
     "--enable-full-sharding-in-hsdp --fsdp-double-buffer --fsdp-manual-registration "
     "--torch-fsdp2-no-reshard-after-forward --suggested-communication-unit-size "
     "--init-model-with-meta-device --disable-strict-fsdp-dtensor-load "
     "--no-strict-fsdp-dtensor-load --megatron-fsdp-enable-fine-grained-param-gather "
     "--megatron-fsdp-grad-comm-dtype --megatron-fsdp-main-grads-dtype "
     "--megatron-fsdp-main-params-dtype --megatron-fsdp-max-pool-double-buffer "
     "--fsdp-db-use-persist-buf-on-alloc-fail"),
    ("weight sharding beyond tensor parallelism (GTP) is not supported: weights are split over "
     "--tensor-model-parallel-size (experts: --expert-tensor-parallel-size) ranks; drop it",
     "--tensor-parallel-num-weight-shards --expert-tensor-parallel-num-weight-shards"),
    ("chunking the MLP along the sequence is not supported: use --mlp-chunks-for-training 1 "
     "(the default, accepted)", "--mlp-chunks-for-training=1"),
    ("changes how gradients are reduced or divided, while --recover sums exactly B microbatch "
     "gradients and divides once; drop it", "--ddp-average-in-collective "
     "--ddp-reduce-scatter-with-fp32-accumulation --ddp-num-buckets --create-all-gather-group "
     "--overlap-param-gather-with-optimizer-step --disable-gloo-process-groups "
     "--use-tp-pp-dp-mapping --lazy-mpu-init --fake-process-group "
     "--pipeline-model-parallel-comm-backend --use-ring-exchange-p2p "
     "--defer-embedding-wgrad-compute --wgrad-deferral-limit --delay-wgrad-compute "
     "--overlap-dispatch-backward-with-experts-wgrad "
     "--ddp-param-name-patterns-for-fp32-local-accumulation"),
    ("it rounds a global batch down to a multiple of micro-batch x data-parallel size; here "
     "every global batch, those of --step-batch-size-schedule included, must be such a "
     "multiple, as Megatron-LM requires without the flag (and the batch stays B after failures "
     "by design): choose sizes that divide and drop it", "--decrease-batch-size-if-needed"),
    ("deprecated by Megatron-LM 0.19, whose calculator ignores it and trains at "
     "--global-batch-size; drop it for that run, or give the ramp as "
     "--step-batch-size-schedule", "--rampup-batch-size"),
    ("evaluation runs with the training --micro-batch-size and --global-batch-size, every "
     "--eval-interval iterations from the first and at the end; other evaluation batch sizes "
     "and a later first evaluation are not supported: drop it", "--eval-micro-batch-size "
     "--eval-global-batch-size --start-eval-at-iter"),
    ("Adam is the only optimizer (Megatron-LM's default); use --optimizer adam or drop it",
     "--optimizer=adam --sgd-momentum --muon-momentum --muon-no-split-qkv "
     "--muon-num-ns-steps --muon-scale-mode --muon-fp32-matmul-prec --muon-tp-mode "
     "--muon-extra-scale-factor --muon-nesterov --muon-coefficient-type --muon-scalar-optimizer "
     "--no-use-layer-wise-param-layout --lion-beta1 --lion-beta2 "
     "--use-precision-aware-optimizer --main-grads-dtype "
     "--main-params-dtype --exp-avg-dtype --exp-avg-sq-dtype"),
    ("weight decay applies to every parameter but biases and norms (Megatron's default rule); "
     "other rules are not supported", "--no-weight-decay-cond-type --apply-wd-to-qk-layernorm"),
    ("a deprecated Megatron-LM spelling; use the current flag (--micro-batch-size, "
     "--recompute-activations, --lr-warmup-iters, --tensor-model-parallel-size, "
     "--position-embedding-type rope, --ckpt-format)", "--batch-size --checkpoint-activations "
     "--warmup --model-parallel-size --use-rotary-position-embeddings --dist-ckpt-format "
     "--use-dist-ckpt"),
    ("this checkpoint option is not supported: --save/--load/--save-interval save and resume the "
     "complete state (model, optimizer, RNG, scheduler, data position); drop it",
     "--auto-detect-ckpt-format --ckpt-assume-constant-structure "
     "--ckpt-convert-format --ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format "
     "--no-ckpt-fully-parallel-save "
     "--dist-ckpt-optim-fully-reshardable --dist-ckpt-save-pre-mcore-014 --dist-ckpt-strictness "
     "--distrib-optim-fully-reshardable-mem-efficient "
     "--load-main-params-from-ckpt --no-save-optim --no-save-rng "
     "--non-persistent-ckpt-type --non-persistent-global-ckpt-dir "
     "--non-persistent-local-ckpt-algo --non-persistent-local-ckpt-dir "
     "--non-persistent-save-interval "
     "--replication --replication-factor --replication-jump --save-dgrads-interval "
     "--save-wgrads-interval --save-activations-interval --save-params-interval "
     "--save-tokens-per-expert-interval --save-retain-interval --use-checkpoint-args "
     "--use-mp-args-from-checkpoint-args --use-persistent-ckpt-worker "
     "--disable-use-tokenizer-model-from-checkpoint-args "
     "--no-use-tokenizer-model-from-checkpoint-args --override-ckpt-iteration --verify-integrity "
     "--disable-ckpt-load-validate-sharding-integrity --no-ckpt-load-validate-sharding-integrity"),
    ("not supported: the job trains for --train-iters / --train-samples (or until an --exit-* "
     "flag stops it) and evaluates the one validation split of --split; drop it",
     "--skip-train --test-mode --iterations-to-skip --full-validation --multiple-validation-sets "
     "--validation-set-names"),
    ("Megatron-LM's rerun engine and its checks are not supported (megatron-recover's own "
     "per-iteration audit checks every committed gradient; under --recover, "
     "--recover-nonfinite-rerun runs a non-finite gradient's microbatches again, in place and on "
     "another replica, to tell a transient fault, a faulty device and bad data apart); drop it",
     "--rerun-mode "
     "--check-for-spiky-loss --check-for-large-grads --error-injection-rate "
     "--error-injection-type --result-rejected-tracker-filename "
     "--check-weight-hash-across-dp-replicas-interval --deterministic-mode "
     "--batch-invariant-mode --dump-param-to-param-group-map"),
    ("the replicas must start identical; drop it", "--data-parallel-random-init"),
    ("a model-architecture option that megatron-recover does not build or test (GPT with "
     "LayerNorm/RMSNorm, learned or rotary positions, GeLU or SwiGLU, GQA, as in Megatron-LM's "
     "GPT-3 and Llama-3 examples); drop it", "--spec --yaml-cfg --heterogeneous-layers-config-path "
     "--heterogeneous-layers-config-encoded-json --is-hybrid-model "
     "--hybrid-override-pattern --mamba-state-dim --mamba-head-dim "
     "--mamba-num-groups --mamba-num-heads --disable-mamba-mem-eff-path "
     "--experimental-attention-variant --linear-attention-freq --linear-conv-kernel-dim "
     "--linear-key-head-dim --linear-value-head-dim --linear-num-key-heads "
     "--linear-num-value-heads --multi-latent-attention --q-lora-rank --kv-lora-rank "
     "--qk-head-dim --qk-pos-emb-head-dim --v-head-dim --cache-mla-latents --mscale "
     "--mscale-all-dim --rotary-scaling-factor --dsa-indexer-n-heads --dsa-indexer-head-dim "
     "--dsa-indexer-topk --dsa-indexer-loss-coeff --dsa-indexer-use-sparse-loss "
     "--dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 --dsa-indexer-rope-interleaved "
     "--dsa-indexer-skip-topk-offset --dsa-indexer-topk-freq --dsa-kernel-backend "
     "--disable-dsa-indexer-rotate-activation --no-dsa-indexer-rotate-activation "
     "--disable-dsa-indexer-scoring-relu --no-dsa-indexer-scoring-relu --mtp-num-layers "
     "--mtp-loss-scaling-factor --mtp-standalone --mtp-detach-heads --mtp-use-repeated-layer "
     "--mtp-hybrid-override-pattern --hybrid-layer-pattern --mamba-training-ssm-states-dtype "
     "--mla-down-proj-fusion --yarn-beta-fast --yarn-beta-slow "
     "--yarn-correction-range-round-to-int --no-yarn-correction-range-round-to-int "
     "--yarn-original-max-position-embeddings --mrope-section --window-size "
     "--window-attn-skip-freq --softmax-type --attention-output-gate --qk-clip --qk-clip-alpha "
     "--qk-clip-threshold --qk-l2-norm --use-kitchen-attention --kitchen-attention-backend "
     "--glu-linear-offset --activation-func-clamp-value --use-fused-weighted-squared-relu "
     "--use-te-activation-func --squared-relu --openai-gelu --quick-geglu --onnx-safe "
     "--apply-residual-connection-post-layernorm --fp32-residual-connection "
     "--apply-query-key-layer-scaling --add-qkv-bias --rotary-interleaved "
     "--no-rope-freq --use-rope-scaling --rope-scaling-factor --rope-type "
     "--rotary-seq-len-interpolation-factor --embedding-init-method-std "
     "--init-method-xavier-uniform --no-initialization --distribute-saved-activations "
     "--recompute-modules --fp16-lm-cross-entropy --te-rng-tracker "
     "--inference-rng-tracker --encoder-num-layers --decoder-num-layers --encoder-seq-length "
     "--decoder-seq-length --relative-attention-num-buckets --relative-attention-max-distance "
     "--bert-no-binary-head --bert-embedder-type --output-bert-embeddings --mask-prob "
     "--short-seq-prob --vocab-extra-ids"),
    ("MuP (maximal update parametrization: initialization, learning rates, attention and "
     "output scaled by width) is not supported: megatron-recover uses Megatron's standard "
     "parametrization; drop it", "--use-mup --mup-width-mult --mup-base-hidden-size "
     "--mup-base-head-dim --mup-attn-scale-power --mup-embedding-mult --mup-output-mult"),
    ("Transformer Engine's fused-operation paths (the op fuser, grouped GEMMs for the dense and "
     "shared-expert MLPs, the fused residual RMSNorm) are not supported: the model is built "
     "from megatron-core's layer specs without them; drop it",
     "--use-transformer-engine-op-fuser --use-grouped-gemm-for-dense-mlp "
     "--use-grouped-gemm-for-shared-expert --fused-residual-rmsnorm"),
    ("pinning the FlashAttention generation is not supported (Megatron-LM needs it for "
     "batch-invariant mode, refused here): Transformer Engine picks the installed one; drop it",
     "--flash-attention-version"),
    ("attention restricted to documents through packed-sequence boundaries (cu_seqlens) is not "
     "supported: --reset-attention-mask (with --reset-position-ids) masks attention across "
     "documents with the dataloader's attention mask instead",
     "--dataloader-inter-document-masking"),
    ("these data-loader options are not supported: give the corpora as a --data-path blend (W1 "
     "PREFIX1 W2 PREFIX2 ...) split by --split, or per-split blends (--train-data-path ...)",
     "--per-dataset-sequences-path --mid-level-dataset-surplus --object-storage-cache-path "
     "--phase-transition-iterations --dataloader-type=single --allow-ambiguous-pad-tokens "
     "--sample-rate --fim-data --fim-rate --fim-spm-rate --fim-split-sample "
     "--fim-fragment-rate --fim-no-prefix --fim-prefix-token --fim-middle-token "
     "--fim-suffix-token --fim-pad-token --fim-eod-token --sft --sft-tokenizer-prompt-format"),
    ("knowledge distillation from saved logits is not supported: pretrain_gpt_recover.py trains "
     "on the language-model loss; drop it", "--logits-save-dir --logits-save-top-k "
     "--logits-save-top-p --logits-save-top-p-min-k --logits-save-dtype --logits-load-dir "
     "--logits-load-kd-loss-alpha --logits-load-ignore-errors --logits-load-decode-threads "
     "--logits-load-prefetch-factor --logits-load-msc-prefetch-depth"),
    ("freezing the model's parameters is not supported: every parameter trains; drop it",
     "--freeze-all-layers"),
    ("the multi-storage client is not supported: every path is a local file; drop it",
     "--enable-msc"),
    ("Megatron-LM's orderly shutdown on SIGINT/SIGTERM (without a checkpoint) is not supported: "
     "use --exit-signal-handler (with --exit-signal), which stops after the current iteration "
     "and saves to --save", "--exit-signal-handler-for-training"),
    ("Megatron-LM's fault injector is not supported: inject failures with "
     "--recover-failure-schedule (docs/failures.md)", "--fault-injector-fault-types "
     "--fault-injector-fault-probabilities --fault-injector-fault-delay "
     "--fault-injector-delay-start-iteration --fault-injector-mtti-seconds "
     "--fault-injector-offset-seconds --fault-injector-num-ranks --fault-injector-ranks "
     "--fault-injector-seed"),
    ("tokenizer option not supported: every tokenizer type loads through megatron-core's "
     "tokenizer classes with their defaults from local files (Megatron-LM's default system); "
     "preprocess and train without it", "--padded-vocab-size --disable-pad-vocab-size "
     "--no-pad-vocab-size --tokenizer-hf-no-use-fast --tokenizer-hf-no-include-special-tokens "
     "--tokenizer-metadata --tokenizer-sentencepiece-legacy "
     "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces "
     "--no-tokenizer-sentencepiece-ignore-extra-whitespaces --chat-template "
     "--trust-remote-code"),
    ("inference and serving options; pretrain_gpt_recover.py trains", "--flash-decode "
     "--inference-fuse-tp-communication --mlp-chunks-for-prefill --decode-only-cuda-graphs "
     "--enable-chunked-prefill "
     "--inference-batch-times-seqlen-threshold --inference-coordinator-port "
     "--inference-dynamic-batching --inference-dynamic-batching-block-size "
     "--inference-dynamic-batching-buffer-size-gb "
     "--inference-dynamic-batching-cuda-graph-mixed-prefill-count "
     "--inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens "
     "--inference-dynamic-batching-num-cuda-graphs "
     "--inference-dynamic-batching-paused-buffer-size-gb "
     "--inference-dynamic-batching-track-paused-request-events "
     "--inference-dynamic-batching-unified-memory-level --inference-logging-step-interval "
     "--inference-max-requests --inference-max-seq-length "
     "--inference-wandb-logging --no-inference-wandb-logging --max-tokens-to-oom "
     "--nccl-all-reduce-for-prefill --use-legacy-static-engine --inference-cuda-graph-all-prefills "
     "--inference-cuda-graph-max-tokens --inference-cuda-graph-scope "
     "--inference-disable-ep-consensus --no-inference-disable-ep-consensus "
     "--inference-disable-triton-nvls-kernels --inference-dynamic-batching-async-sched-mode "
     "--inference-dynamic-batching-cuda-graph-sizing-distribution "
     "--inference-dynamic-batching-logprobs-mode --inference-dynamic-batching-mamba-memory-ratio "
     "--inference-dynamic-batching-prefix-caching --no-inference-dynamic-batching-prefix-caching "
     "--inference-dynamic-batching-prefix-caching-coordinator-policy "
     "--inference-dynamic-batching-prefix-caching-eviction-policy "
     "--inference-dynamic-batching-prefix-caching-mamba-gb "
     "--inference-dynamic-batching-prefix-caching-routing-alpha "
     "--inference-dynamic-batching-sampling-backend "
     "--inference-dynamic-batching-track-generated-token-events --inference-grouped-gemm-backend "
     "--inference-moe-disable-fused-quant-kernels --inference-moe-token-dispatcher-type "
     "--inference-shards --inference-text-gen-server-logging "
     "--no-inference-text-gen-server-logging --inference-use-synchronous-zmq-collectives "
     "--no-inference-use-synchronous-zmq-collectives --mamba-inference-conv-states-dtype "
     "--mamba-inference-ssm-states-dtype --num-speculative-tokens "
     "--use-same-sampling-seed-across-dp-ranks"),
    ("reinforcement-learning options; pretrain_gpt_recover.py does pre-training",
     "--perform-rl-step --grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-entropy-term-weight "
     "--grpo-filter-groups-with-same-reward --grpo-group-size --grpo-iterations --grpo-kl-beta "
     "--grpo-prompts-per-step --langrl-env-config --refit-method --rl-default-temperature "
     "--rl-default-top-k "
     "--rl-default-top-p --rl-importance-sampling-truncation-coef "
     "--rl-inference-expert-model-parallel-size "
     "--rl-inference-expert-tensor-model-parallel-size --rl-inference-logprobs-is-correction "
     "--no-rl-inference-logprobs-is-correction --rl-inference-model-unified-memory-level "
     "--rl-inference-pipeline-model-parallel-size --rl-inference-tensor-model-parallel-size "
     "--rl-offload-inference-model-weights-when-idle "
     "--no-rl-offload-inference-model-weights-when-idle --rl-offload-optimizer-during-inference "
     "--rl-partial-rollouts --no-rl-partial-rollouts --rl-prompts-per-eval "
     "--rl-sequence-packing-algo --rl-sequence-packing-max-sequences-per-bin "
     "--rl-skip-bos-token --no-rl-skip-bos-token --rl-training-cuda-graphs "
     "--no-rl-training-cuda-graphs --rl-use-sequence-packing --no-rl-use-sequence-packing "
     "--rl-verify-model-weights-swap --no-rl-verify-model-weights-swap "
     "--rl-consumption-granularity --rl-generation-lag --rl-inference-parsers "
     "--rl-kv-cache-management-mode --rl-persist-cuda-graphs --no-rl-persist-cuda-graphs "
     "--rl-profile --rl-profile-dir --rl-submission-granularity"),
    ("retrieval (biencoder) and vision models are not GPT pre-training", "--bert-load "
     "--biencoder-projection-dim --biencoder-shared-query-context-model --block-data-path "
     "--embedding-path --evidence-data-path --ict-head-size --ict-load --indexer-batch-size "
     "--indexer-log-interval --query-in-block-prob --retriever-report-topk-accuracies "
     "--retriever-score-scaling --titles-data-path --use-one-sent-docs --classes-fraction "
     "--data-per-class-fraction --dino-bottleneck-size --dino-freeze-last-layer "
     "--dino-head-hidden-size --dino-local-crops-number --dino-local-img-size "
     "--dino-norm-last-layer --dino-teacher-temp --dino-warmup-teacher-temp "
     "--dino-warmup-teacher-temp-epochs --head-lr-mult --img-h --img-w --iter-per-epoch "
     "--mask-factor --mask-type --no-data-sharding --num-channels --num-classes --patch-dim "
     "--swin-backbone-type --vision-backbone-type --vision-pretraining "
     "--vision-pretraining-type"),
    ("megatron-recover replaces restarting: with --recover the job survives a failure in-step, "
     "without a relaunch or a restart of the process; use --recover",
     "--inprocess-restart --inprocess-active-world-size --inprocess-barrier-timeout "
     "--inprocess-completion-timeout --inprocess-empty-cuda-cache --inprocess-granularity "
     "--inprocess-hard-timeout --inprocess-heartbeat-interval --inprocess-heartbeat-timeout "
     "--inprocess-last-call-wait --inprocess-max-iterations --inprocess-monitor-process-interval "
     "--inprocess-monitor-thread-interval --inprocess-progress-watchdog-interval "
     "--inprocess-soft-timeout --inprocess-termination-grace-time --enable-ft-package "
     "--calc-ft-timeouts --ft-num-warmup-iters --adlr-autoresume --adlr-autoresume-interval"),
    ("experimental Megatron-LM features are not supported", "--enable-experimental "
     "--run-workload-inspector-server"),
)


def _entries(status: str, groups) -> dict[str, Entry]:
    entries = {}
    for reason, names in groups:
        for item in names.split():
            if status == NO_EFFECT:
                name, _, nargs = item.partition(":")
                entry = Entry(status, reason, nargs={"": 0, "1": 1, "*": "*"}[nargs])
            else:
                name, _, accepted = item.partition("=")
                entry = Entry(status, reason, accepts=(accepted,) if accepted else ())
            assert name not in entries, f"{name} listed twice"
            entries[name] = entry
    return entries


NO_EFFECT_ARGS = _entries(NO_EFFECT, _NO_EFFECT_GROUPS)
REFUSED_ARGS = _entries(REFUSED, _REFUSED_GROUPS)
assert not NO_EFFECT_ARGS.keys() & REFUSED_ARGS.keys()

# When an implemented flag's value or device is refused (the start-up validation gives the
# full reason), or its meaning differs from Megatron-LM's.
IMPLEMENTED_NOTES = {
    "--transformer-impl": "absent: transformer_engine where Transformer Engine imports (Megatron-"
                          "LM's default), otherwise local, said at start-up; transformer_engine "
                          "refused where it does not import",
    "--use-flash-attn": "refused where Transformer Engine does not import",
    "--attention-backend": "local layer spec: megatron-core's own attention whatever the backend "
                           "(said at start-up); flash and fused select Transformer Engine kernels",
    "--cross-entropy-loss-fusion": "on CPU the unfused cross entropy runs (same loss; said at "
                                   "start-up): the fused kernel is CUDA-only",
    "--gradient-accumulation-fusion": "refused on CPU (a CUDA kernel); on CUDA Megatron's "
    "default, refused at start-up when Apex's fused_weight_gradient_mlp_cuda does not import "
    "(pass --no-gradient-accumulation-fusion)",
    "--distributed-backend": "megatron's own (training) groups on CUDA: nccl (default) or gloo; "
    "gloo on CPU; control collectives always on gloo mirrors (docs/devices.md)",
    "--recover-ranks-per-device": "N consecutive node-local ranks bind one GPU (default 1, one "
    "rank per GPU); refused on CUDA when a replica has more than one rank (NCCL)",
    "--recover-data-plane": "torch (default with torch 2.14+: gloo on CPU, NCCL on CUDA, "
    "reconfigured over survivors) or mpi (the ulfm group); torch refused with "
    "--recover-ranks-per-device > 1 on CUDA (docs/data-planes.md)",
    "--recover-cuda-aware-mpi": "hands the cross-replica buffers on the GPU to MPI; refused on "
    "CPU, and at start-up unless MPIX_Query_cuda_support() says the MPI has CUDA "
    "(docs/devices.md)",
    "--no-gradient-accumulation-fusion": "",
    "--expert-model-parallel-size": "under --recover each expert-parallel group lies inside one "
    "replica: a distributed-optimizer instance whose data-parallel ranks are a multiple of it "
    "(without --num-distributed-optimizer-instances, DP / E instances of E ranks; other "
    "layouts refused with the layout to use; docs/training.md)",
    "--expert-tensor-parallel-size": "only the default, --tensor-model-parallel-size",
    "--moe-router-load-balancing-type": "one of aux_loss (default), seq_aux_loss, none; "
    "global_aux_loss, sinkhorn, quantile_balancing and several types at once are refused",
    "--moe-router-score-function": "softmax (default) or sigmoid; sqrtsoftplus is refused (an "
    "argparse error)",
    "--moe-aux-loss-coeff": "one coefficient; under --recover its gradient is divided by the "
    "iteration's B, as the language-model loss is",
    "--moe-token-dispatcher-type": "allgather (default) or alltoall; flex is refused (DeepEP, "
    "HybridEP)",
    "--moe-grouped-gemm": "refused unless CUDA and Transformer Engine (or grouped_gemm with "
    "--transformer-impl local) import",
    "--moe-permute-fusion": "refused unless CUDA and Transformer Engine import",
    "--moe-router-fusion": "refused unless CUDA and Transformer Engine import",
    "--moe-expert-capacity-factor": "tokens are dropped per forward of one microbatch, so a "
    "microbatch drops the same tokens on whichever replica runs it (exact under --recover)",
    "--no-load-optim": "Megatron-LM's meaning: neither the optimizer nor the scheduler is "
    "loaded (docs/checkpoints.md)",
    "--no-load-rng": "Megatron-LM's meaning: the generators are not loaded",
    "--finetune": "Megatron-LM's meaning: the model only; the run starts at iteration 1",
    "--pretrained-checkpoint": "Megatron-LM's meaning: when --load holds no checkpoint, "
    "fine-tune from this one",
    "--ckpt-step": "Megatron-LM's meaning: load this iteration instead of the tracker's",
    "--exit-on-missing-checkpoint": "Megatron-LM's meaning: --load without a checkpoint stops",
    "--async-save": "Megatron-LM's meaning: a save returns once its tensors are in host memory, "
    "a background process writes them, and a later iteration completes the checkpoint (the "
    "tracker moves then; the next save and the end of training wait for it); refused with "
    "--ckpt-format torch, as in Megatron-LM",
    "--ckpt-format": "torch_dist (the default; stock and --recover runs load each other's) or, "
                     "under --recover, torch (per-position files of this project's own)",
    "--use-distributed-optimizer": "with --recover the optimizer state is sharded inside each "
                                   "replica, never across replicas (see "
                                   "--num-distributed-optimizer-instances)",
    "--num-distributed-optimizer-instances": "--recover with --use-distributed-optimizer: "
                                             "default one instance per data-parallel rank "
                                             "(Megatron-LM: 1), said at start-up; 1 is refused "
                                             "when DP > 1; K shards each instance over DP / K "
                                             "ranks",
    "--num-layers-per-virtual-pipeline-stage": "the interleaved schedule; under --recover a "
                                               "pass shorter than the pipeline is padded with "
                                               "loss-masked microbatches (docs/training.md)",
    "--num-virtual-stages-per-pipeline-rank": "as --num-layers-per-virtual-pipeline-stage",
    "--microbatch-group-size-per-virtual-pipeline-stage": "a full pass must fit it (refused at "
                                                          "start-up otherwise); under --recover "
                                                          "a shorter pass runs as one group",
    "--no-overlap-p2p-communication": "refused with PP = 2 and virtual stages (megatron-core "
                                      "pairs the batched sends and receives wrongly there)",
    "--no-align-param-gather": "stock runs; under --recover every chunk's all-gathers are "
                               "dispatched after the optimizer step, so it changes nothing",
    "--overlap-grad-reduce": "with PP > 1 every stage starts its reductions as its buckets "
                             "fill (Megatron-LM by default holds the later stages' for the "
                             "pipeline bubble, as --no-align-grad-reduce turns off); the same "
                             "gradients",
    "--ddp-bucket-size": "must be >= 1 (Megatron-LM: 0 or less puts each parameter in its own "
                         "bucket)",
    "--sequence-parallel": "with the local layer spec it also runs without Apex (Megatron-LM's "
                          "torch-norm fallback refuses it)",
    "--position-embedding-type": "learned_absolute or rope; yarn, mrope, relative and none are "
                                 "refused (an argparse error)",
    "--max-position-embeddings": "optional: default --seq-length; with rope it may be below "
                                 "--seq-length (Megatron-LM: required, and at least "
                                 "--seq-length)",
    "--num-query-groups": "must be a multiple of --tensor-model-parallel-size (Megatron-LM also "
                          "accepts fewer groups than TP ranks when they divide it)",
    "--recompute-activations": "refused with --recompute-granularity full (Megatron-LM: "
                               "--recompute-activations wins and recomputes selectively)",
    "--recompute-method": "refused without --recompute-granularity (Megatron-LM ignores it "
                          "then)",
    "--recompute-num-layers": "refused without --recompute-granularity (Megatron-LM ignores it "
                              "then) and above the layers of one pipeline stage (Megatron-LM's "
                              "block method then recomputes every layer)",
    "--cross-entropy-fusion-impl": "te is refused where Transformer Engine does not import, "
                                   "even without --cross-entropy-loss-fusion (Megatron-LM reads "
                                   "it only with that flag, and core_v0.19.0 refuses te with "
                                   "it)",
    "--hidden-dropout": "must be in [0, 1) (Megatron-LM does not check); --recover exact mode "
                        "seeds the masks per microbatch (see --seed)",
    "--attention-dropout": "must be in [0, 1) (Megatron-LM does not check); --recover exact "
                           "mode seeds the masks per microbatch (see --seed)",
    "--apply-layernorm-1p": "also with the local layer spec and RMSNorm, or without Apex "
                            "(Megatron-LM's torch-norm fallback refuses it there)",
    "--normalization": "with the local layer spec also under --sequence-parallel without Apex "
                       "(Megatron-LM's torch-norm fallback refuses that)",
    "--seed": "initialization as Megatron-LM (seed + 100 x pipeline stage); --recover exact "
              "mode reseeds dropout for every microbatch from (seed, iteration, microbatch id, "
              "stage), so a microbatch draws the same masks on whichever replica runs it",
    "--train-samples": "fewer samples than one global batch (or than the schedule's first "
                       "step) are refused (Megatron-LM trains the whole global batches that "
                       "fit, possibly none)",
    "--lr-warmup-iters": "negative refused (Megatron-LM accepts it: no warmup, the decay "
                         "starts part-way)",
    "--lr-warmup-samples": "negative refused (Megatron-LM accepts it: no warmup, the decay "
                           "starts part-way)",
    "--lr-warmup-fraction": "negative refused (Megatron-LM accepts it: no warmup, the decay "
                            "starts part-way)",
    "--lr-wsd-decay-iters": "refused with --train-samples (Megatron-LM ignores it in a "
                            "sample-based run)",
    "--lr-wsd-decay-samples": "refused with --train-iters (Megatron-LM ignores it in an "
                              "iteration-based run)",
    "--decoupled-lr": "refused when negative or below --decoupled-min-lr (Megatron-LM accepts "
                      "both)",
    "--decoupled-min-lr": "refused without --decoupled-lr (Megatron-LM accepts it, with no "
                          "effect)",
    "--grad-reduce-in-bf16": "refused without --bf16 (Megatron-LM ignores it then)",
    "--no-check-for-nan-in-loss-and-grad": "the check it turns off is Megatron-LM's (a NaN or "
                                           "inf microbatch loss or bucket gradient norm before "
                                           "the data-parallel reduction); a stock run stops on "
                                           "it as Megatron-LM's does; under --recover a NaN loss "
                                           "ends the job as a program error, and a replica with "
                                           "a non-finite gradient but finite losses leaves as a "
                                           "device fault does, the others redoing its "
                                           "microbatches (docs/failures.md)",
    "--data-cache-path": "the cached index files are named from this project's tokenizer "
                         "identity and the absolute data path, so a cache Megatron-LM built is "
                         "not reused (the same indices are built again)",
    "--merge-file": "read as GPT-2's merges.txt, as Megatron-LM's GPT2BPETokenizer does; "
                    "refused where --tokenizer-type does not read it",
    "--vocab-file": "refused where --tokenizer-type does not read it (Megatron-LM ignores it or "
                    "hands it to AutoTokenizer)",
    "--tokenizer-model": "local files only; HuggingFaceTokenizer: a directory, loaded as the "
                         "fast tokenizer (as Megatron-LM's default; its "
                         "--tokenizer-hf-no-use-fast is refused); refused where "
                         "--tokenizer-type does not read it",
    "--split": "a train share of 0 is refused (Megatron-LM then only evaluates); a split with "
               "no validation documents is not evaluated (Megatron-LM fails at its first "
               "evaluation); checked with --mock-data too, which splits evenly",
    "--save-interval": "must be >= 1 even without --save (Megatron-LM checks it only with "
                       "--save)",
    "--eval-iters": "negative refused (Megatron-LM evaluates only when it is > 0)",
    "--log-throughput": "under --recover, TFLOP/s per live rank; values under 0.1 print as "
                        "%.2e",
    "--log-timers-to-tensorboard": "iteration-time and throughput are written every "
                                   "--tensorboard-log-interval with that iteration's time "
                                   "(Megatron-LM: every --log-interval, the interval's mean)",
    "--log-validation-ppl-to-tensorboard": "also logged to W&B (Megatron-LM: TensorBoard only)",
    "--tensorboard-log-interval": "must be >= 1 (Megatron-LM does not check; 0 fails at the "
                                  "first iteration with --tensorboard-dir)",
    "--tensorboard-queue-size": "must be >= 1 (Megatron-LM: 0 or less is an unbounded queue)",
    "--wandb-exp-name": "empty: W&B's generated name (Megatron-LM refuses an explicit empty "
                        "name)",
    "--wandb-save-dir": "default SAVE/wandb, or ./wandb without --save (Megatron-LM fails "
                        "without --save)",
    "--wandb-project": "refused where the wandb package is not installed; the values go to W&B "
                       "without --tensorboard-dir too (Megatron-LM: only with TensorBoard on), "
                       "without its samples-vs-steps values and the argument config",
    "--exit-duration-in-mins": "the ranks agree on the last iteration (any rank past the "
                               "duration stops them all after that iteration), counted from "
                               "each rank's process start (Megatron-LM: from pretrain's start); "
                               "fractional minutes accepted (Megatron-LM: whole minutes); not "
                               "checked inside an evaluation",
    "--exit-interval": "an exit due at the last iteration does not skip the end-of-training "
                       "evaluations (Megatron-LM exits before them)",
    "--exit-signal-handler": "installed once the model is built (Megatron-LM: at initialization), "
                             "so the signal during start-up has its default effect; a signal in "
                             "the last iteration does not skip the end-of-training evaluations",
    "--exit-signal": "SIGKILL and SIGSTOP are refused at start-up (they cannot be caught)",
    "--eval-interval": "absent or 0: only the evaluation at the end of training, the meaning "
                       "Megatron-LM core_v0.19.0 documents (its validation-split sizing divides "
                       "by the flag and fails without it)",
    "--log-world-size-to-tensorboard": "--recover: the live ranks, which fall after failures "
                                       "(Megatron-LM: the launch world size)",
    "--vocab-size": "alone (no --tokenizer-type, --vocab-file or --tokenizer-model) selects "
                    "NullTokenizer (Megatron-LM's pretrain_gpt defaults to GPT2BPETokenizer); "
                    "refused with the tokenizer types that do not read it (all but "
                    "NullTokenizer and TikTokenizer; Megatron-LM ignores it there)",
    "--tiktoken-pattern": "v1 or v2, v2 when absent (as Megatron-LM core_v0.19.0); with "
                          "another --tokenizer-type it has no effect and start-up says so",
    "--tiktoken-num-special-tokens": "with another --tokenizer-type than TikTokenizer it has no "
                                     "effect and start-up says so",
    "--tokenizer-special-tokens": "TikTokenizer's special tokens only: refused with the other "
                                  "types (Megatron-LM hands them to Hugging Face tokenizers, and "
                                  "to SentencePiece ones only with "
                                  "--tokenizer-sentencepiece-legacy, refused here)",
    "--reset-attention-mask": "turns the dataloader's attention mask on even with "
                              "--no-create-attention-mask-in-dataloader (Megatron-LM builds none "
                              "then, and the reset has no effect)",
    "--null-tokenizer-eod-id": "must be an id of the vocabulary, 0..--vocab-size - 1 "
                               "(Megatron-LM does not check); with another --tokenizer-type it "
                               "has no effect and start-up says so",
    "--null-tokenizer-pad-id": "with another --tokenizer-type it has no effect and start-up "
                               "says so",
    "--mock-data": "--data-cache-path is not used for the mock dataset (Megatron-LM caches its "
                   "indices there)",
    "--tensorboard-dir": "written by the lowest live rank; a rank that takes over continues the "
                         "same curves",
    "--save": "--recover: this project's own files in Megatron's iter_NNNNNNN/ directories "
              "(docs/checkpoints.md), which Megatron-LM does not load; stock runs: torch_dist "
              "as in Megatron-LM",
    "--load": "--recover: only checkpoints of its own --save, on the same or fewer replicas "
              "(B kept); a Megatron-LM checkpoint stops the load (its per-rank file is not ours)",
    "--data-path": "a blend's prefixes must each have their .bin/.idx, and its weights be >= 0, "
                   "checked at start-up",
    "--tokenizer-type": "GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, "
                        "GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer or "
                        "NullTokenizer, from local files (BERT, multimodal and SFT types are "
                        "refused at start-up); the data's ids are megatron-core's, as Megatron-LM "
                        "builds them (docs/training.md)",
    "--log-interval": "--recover: the iteration line adds live replicas, contributions/B and "
                      "failures (docs/observability.md); as in Megatron-LM, each launch's "
                      "first iteration gets a line whatever the interval and the next line "
                      "averages that iteration in again; the elapsed time per iteration is the "
                      "mean of the steps' "
                      "own times (Megatron-LM: the interval's wall clock, evaluations and saves "
                      "left out)",
}


def split_refused(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without the refused flags and their values, one problem line per refused flag).

    Megatron-LM's parser has no positional arguments, so the values of a flag are the tokens up
    to the next one that starts with "--" (or the part after "=").
    """
    kept, problems, i = [], [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        entry = REFUSED_ARGS.get(name) if name.startswith("--") else None
        if entry is None:
            kept.append(argv[i])
            i += 1
            continue
        values = [value] if eq else []
        i += 1
        while not eq and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        if not (entry.accepts and values == list(entry.accepts)):
            problems.append(f"{name}: {entry.reason}")
    return kept, problems


def add_no_effect_args(parser: argparse.ArgumentParser) -> None:
    """The no-effect flags, accepted with Megatron-LM's arity; absent from the namespace unless
    given (nothing reads them)."""
    g = parser.add_argument_group("no effect here (each one given is named at start-up, with "
                                  "the reason)")
    for name, entry in NO_EFFECT_ARGS.items():
        if entry.nargs == 0:
            g.add_argument(name, action="store_true", default=argparse.SUPPRESS)
        else:
            g.add_argument(name, nargs=None if entry.nargs == 1 else "*",
                           default=argparse.SUPPRESS)


def no_effect_given(argv: list[str]) -> tuple[str, ...]:
    """The no-effect flags in argv, in command-line order, each once."""
    given = []
    for token in argv:
        name = token.split("=", 1)[0]
        if name in NO_EFFECT_ARGS and name not in given:
            given.append(name)
    return tuple(given)


def no_effect_lines(names: tuple[str, ...]) -> list[str]:
    """The start-up lines for the no-effect flags a user gave: one per reason."""
    by_reason: dict[str, list[str]] = {}
    for name in names:
        by_reason.setdefault(NO_EFFECT_ARGS[name].reason, []).append(name)
    return [f"megatron-recover: no effect here: {' '.join(flags)}: {reason}"
            for reason, flags in by_reason.items()]


def table(parser: argparse.ArgumentParser) -> dict[str, Entry]:
    """Every flag `pretrain_gpt_recover.py` knows, with its status: the parser's own flags are
    implemented (ours are marked OURS), the others come from the groups above."""
    entries = {}
    for action in parser._actions:
        for name in action.option_strings:
            if not name.startswith("--") or name in NO_EFFECT_ARGS:
                continue
            ours = name.startswith(("--recover", "--cross-replica-backend",
                                    "--gradient-accumulation-fusion"))
            entries[name] = Entry(OURS if ours else IMPLEMENTED, IMPLEMENTED_NOTES.get(name, ""))
    for name, entry in {**NO_EFFECT_ARGS, **REFUSED_ARGS}.items():
        assert name not in entries, f"{name} is both parsed and {entry.status}"
        entries[name] = entry
    return dict(sorted(entries.items()))


def markdown(parser: argparse.ArgumentParser) -> str:
    """docs/arguments.md: counts per status; the implemented flags by the parser's areas, each
    with its note where it differs from Megatron-LM; the refused and no-effect flags grouped by
    their reason."""
    entries = table(parser)
    counts = {status: sum(e.status == status for e in entries.values())
              for status in (IMPLEMENTED, REFUSED, NO_EFFECT, OURS)}
    lines = [
        "# Megatron arguments under `pretrain_gpt_recover.py`",
        "",
        "Generated by `scripts/argument_table.py` from `megatron_recover/megatron/"
        "config/argument_table.py` and the parser; `tests/test_argument_table.py` checks that this "
        "file is current and that every option of Megatron-LM's parser at core_v0.19.0 has a "
        "status. Do not edit by hand.",
        "",
        "- **implemented**: Megatron-LM's name, meaning and default; the note says when a value "
        "or a device is refused, or how the meaning differs.",
        "- **refused**: the job stops at start-up with the reason and what to use instead.",
        "- **no effect here**: accepted, changes nothing here, named at start-up with the reason.",
        "- **megatron-recover**: our own flags (docs/training.md).",
        "",
        "| status | flags |",
        "|---|---|",
        *(f"| {status} | {count} |" for status, count in counts.items()),
    ]

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    listed = set()
    for group in parser._action_groups:
        names = [name for action in group._group_actions for name in action.option_strings
                 if entries.get(name) and entries[name].status in (IMPLEMENTED, OURS)]
        if not names:
            continue
        listed.update(names)
        title = "general" if group.title in ("options", "optional arguments") else group.title
        lines += ["", f"## {title[0].upper()}{title[1:]}", "", "| flag | note |",
                  "|---|---|"]
        lines += [f"| `{name}` | {cell(entries[name].reason)} |" for name in sorted(names)]
    assert listed == {n for n, e in entries.items() if e.status in (IMPLEMENTED, OURS)}
    for status, title in ((REFUSED, "Refused"), (NO_EFFECT, "No effect here")):
        by_reason: dict[str, list[str]] = {}
        for name, entry in entries.items():
            if entry.status == status:
                reason = entry.reason + (f" (accepted: {name} {' '.join(entry.accepts)})"
                                         if entry.accepts else "")
                by_reason.setdefault(reason, []).append(name)
        lines += ["", f"## {title}", "", "| flags | reason |", "|---|---|"]
        lines += [f"| {' '.join(f'`{n}`' for n in names)} | {cell(reason)} |"
                  for reason, names in by_reason.items()]
    return "\n".join(lines) + "\n"
