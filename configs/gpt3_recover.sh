#!/bin/bash

# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (core_v0.19.0), scaled to this
# machine and launched the megatron-recover way: the same argument groups and flags, sizes a
# 2-core CPU trains in a minute, `mpirun --with-ft ulfm` instead of torchrun, and the
# --recover flags with a failure schedule (a replica dies in a bucket reduce, global rank 0
# during an evaluation).
#
#   configs/gpt3_recover.sh [CHECKPOINT_PATH] [TENSORBOARD_LOGS_PATH] [VOCAB_FILE] \
#       [MERGE_FILE] [DATA_PATH] [FAILURE_SCHEDULE]
#
# Run from the repository root after `make build`. Without DATA_PATH the offline demo corpus is
# built into data/ (seconds). NP ranks (default 8): PP 2 x 4 replicas. DRY_RUN=1 prints the
# command instead of running it. Pass FAILURE_SCHEDULE=none for a failure-free run.

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
MPIRUN=${MPIRUN:-$ROOT/.venv/bin/mpirun}
NP=${NP:-8}

CHECKPOINT_PATH=${1:-runs/gpt3/checkpoints}
TENSORBOARD_LOGS_PATH=${2:-runs/gpt3/tensorboard}
VOCAB_FILE=${3:-data/vocab.json}
MERGE_FILE=${4:-data/merges.txt}
DATA_PATH=${5:-data/corpus_text_document}
FAILURE_SCHEDULE=${6:-$ROOT/configs/failures/gpt3_two_failures.yaml}

if [[ -z "${DRY_RUN:-}" && ! -f "$DATA_PATH.idx" && "$DATA_PATH" == data/corpus_text_document ]]; then
    "$PYTHON" "$ROOT/scripts/make_demo_corpus.py" --output-dir data
fi

GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 16
    # The original's --step-batch-size-schedule is dropped: it passes it with
    # --global-batch-size, which Megatron-LM core_v0.19.0's own argument check refuses ("Cannot
    # specify both"). A schedule here takes --train-samples and no --global-batch-size.
    --train-iters 40
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    # Megatron's default initial scale (2^32) overflows this small model's first ~20 steps.
    --initial-loss-scale 65536
    --lr 6.0e-4
    --lr-decay-style cosine
    --min-lr 6.0e-5
    --lr-warmup-fraction .01
    --lr-decay-iters 34
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 5
    --save-interval 20
    --eval-interval 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --eval-iters 2
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
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${RECOVER_ARGS[@]}"
