#!/bin/bash

# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (core_v0.19.0), scaled to this
# machine and launched the megatron-recover way: the same model, training, DDP, data and
# logging flags, sizes a 2-core CPU trains in a minute, `mpirun --with-ft ulfm` instead of
# torchrun, and the --recover flags with a failure schedule. What differs, and why:
#   DTYPE bf16     fp8 needs Transformer Engine on a GPU (set DTYPE=fp8 there);
#   --num-distributed-optimizer-instances NP   under --recover the distributed optimizer is
#                  one instance per replica, spelled out;
#   no --profile   the PyTorch profiler is refused here (its step flags have no effect);
#   the --split value without the original's literal quotes.
#
#   configs/llama3_recover.sh [CHECKPOINT_PATH] [TENSORBOARD_LOGS_PATH] [TOKENIZER_ARG] \
#       [DATA_ARG] [FAILURE_SCHEDULE]
#
# TOKENIZER_ARG / DATA_ARG "MOCK" (the default): megatron's mock data. NP ranks (default 4):
# 4 replicas of one rank. DRY_RUN=1 prints the command. FAILURE_SCHEDULE=none: no failures.

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
MPIRUN=${MPIRUN:-$ROOT/.venv/bin/mpirun}
NP=${NP:-4}

CHECKPOINT_PATH=${1:-"runs/llama3/checkpoints"}
TENSORBOARD_LOGS_PATH=${2:-"runs/llama3/tensorboard"}
TOKENIZER_ARG=${3:-"MOCK"} # Path to tokenizer model, or "MOCK"
DATA_ARG=${4:-"MOCK"}     # Data prefix, or "MOCK"
FAILURE_SCHEDULE=${5:-$ROOT/configs/failures/llama3_two_failures.yaml}

# Fixed model and training parameters
TP_SIZE=1
CP_SIZE=1
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=16
NUM_LAYERS=2
DTYPE=${DTYPE:-"bf16"}
SEQ_LENGTH=128
MAX_POSITION_EMBEDDINGS=128

# Data cache path (useful for both mock and real data)
DATA_CACHE_PATH="$(dirname "$CHECKPOINT_PATH")/data_cache"

MODEL_ARGS=(
    --use-mcore-models
    --num-layers $NUM_LAYERS
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --kv-channels 16
    --seq-length $SEQ_LENGTH
    --max-position-embeddings $MAX_POSITION_EMBEDDINGS
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --normalization RMSNorm
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --train-samples 480
    --lr-decay-samples 470
    --lr-warmup-samples 16
    --lr 0.0015
    --min-lr 0.0001
    --decoupled-lr 5.0e-3
    --decoupled-min-lr 4.5e-4
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)

DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=(--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
                 --fp8-param-gather)
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --context-parallel-size $CP_SIZE
    --sequence-parallel
)

DDP_ARGS=(
    --use-distributed-optimizer
    --num-distributed-optimizer-instances "$NP"
    --overlap-grad-reduce
    --overlap-param-gather
)
TRAINING_ARGS+=("${DDP_ARGS[@]}")

DATA_ARGS_LIST=()
if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ "$DATA_ARG" == "MOCK" ]] || [[ -z "$TOKENIZER_ARG" ]]; then
    DATA_ARGS_LIST+=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size 1024
        --data-cache-path "$DATA_CACHE_PATH"
        --tiktoken-pattern v2
        --split 99,1,0
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
    )
else
    DATA_ARGS_LIST+=(
        --data-path "$DATA_ARG"
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "$TOKENIZER_ARG"
        --data-cache-path "$DATA_CACHE_PATH"
        --split 99,1,0
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 2
    --eval-interval 10
    --save-interval 20
    --log-throughput
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

RECOVER_ARGS=(
    --recover
    --recover-log "$(dirname "$CHECKPOINT_PATH")/recover.jsonl"
    --recover-hang-timeout 10
)
if [[ "$FAILURE_SCHEDULE" != none ]]; then
    RECOVER_ARGS+=(--recover-failure-schedule "$FAILURE_SCHEDULE")
fi

source "$ROOT/configs/launch.sh"
recover_launch \
    "${MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${DTYPE_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS_LIST[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${RECOVER_ARGS[@]}"
