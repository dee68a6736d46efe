#!/bin/bash

# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (core_v0.19.0), launched the
# megatron-recover way: the same model, MoE, training, parallel and logging flags (the example's
# sizes are already small), `mpirun --with-ft ulfm` instead of torchrun, and the --recover flags
# with a failure schedule. What differs, and why:
#   NP 6 ranks, --global-batch-size 12   the example's 2 ranks are one replica (its
#                  expert-parallel group of 2 must lie inside a replica), which no failure
#                  leaves alive: 3 replicas of 2 ranks, and a batch they split evenly
#                  (start-up makes each replica a distributed-optimizer instance of the 2
#                  data-parallel ranks of one expert-parallel group: 3 instances, and says so);
#   --train-iters 8 and an evaluation every 4  so that the failures land in a reduction, an
#                  extension pass and an evaluation;
#   --save, --save-interval 4   the example's commented-out checkpoint, saved after the
#                  failures (its --no-load-optim --no-load-rng stay: without --load they are
#                  said at start-up to change nothing, as they change nothing in Megatron-LM);
#   MOCK data      NullTokenizer with a 32000-token vocabulary stands for the Llama-2 tokenizer
#                  (the example runs --mock-data too).
#
#   configs/mixtral_recover.sh [CHECKPOINT_PATH] [TENSORBOARD_LOGS_PATH] [TOKENIZER_MODEL] \
#       [FAILURE_SCHEDULE]
#
# TOKENIZER_MODEL "MOCK" (the default): NullTokenizer. DRY_RUN=1 prints the command.
# FAILURE_SCHEDULE=none: no failures.

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
MPIRUN=${MPIRUN:-$ROOT/.venv/bin/mpirun}
NP=${NP:-6}

CHECKPOINT_PATH=${1:-"runs/mixtral/checkpoints"}
TENSORBOARD_LOGS_PATH=${2:-"runs/mixtral/tensorboard"}
TOKENIZER_MODEL=${3:-"MOCK"}
FAILURE_SCHEDULE=${4:-$ROOT/configs/failures/mixtral_two_failures.yaml}

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 256
    --max-position-embeddings 2048
    --num-layers 2
    --hidden-size 256
    --ffn-hidden-size 896
    --num-attention-heads 2
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 2
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

DATA_ARGS=(--mock-data --split 99990,8,2)
if [[ "$TOKENIZER_MODEL" == "MOCK" ]]; then
    DATA_ARGS+=(--tokenizer-type NullTokenizer --vocab-size 32000)
else
    DATA_ARGS+=(--tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL")
fi

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 12
    --lr 1e-4
    --train-iters 8
    --min-lr 1.0e-5
    --weight-decay 0.1
    --clip-grad 1.0
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 2
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 10
    --eval-interval 4
    --no-load-optim
    --no-load-rng
    --save "$CHECKPOINT_PATH"
    --save-interval 4
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
    "${MOE_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" \
    "${RECOVER_ARGS[@]}"
