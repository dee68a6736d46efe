# Sourced by the job scripts in configs/: recover_launch runs pretrain_gpt_recover.py with the
# given arguments on NP ranks under `mpirun --with-ft ulfm` (oversubscribed when NP exceeds the
# cores, one compute thread per rank; root needs Open MPI's explicit permission), or prints the
# command with DRY_RUN=1. It needs ROOT, PYTHON, MPIRUN, NP, CHECKPOINT_PATH and
# TENSORBOARD_LOGS_PATH set by the script.

recover_launch() {
    local mpi_args=(--with-ft ulfm -np "$NP" -x OMP_NUM_THREADS=1 -x PYTHONUNBUFFERED=1)
    if (( NP > $(nproc) )); then
        mpi_args+=(--oversubscribe --mca mpi_yield_when_idle 1)
    fi
    if [[ $(id -u) == 0 ]]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
    local command=("$MPIRUN" "${mpi_args[@]}" "$PYTHON" "$ROOT/pretrain_gpt_recover.py" "$@")
    if [[ -n "${DRY_RUN:-}" ]]; then
        printf '%s\n' "${command[@]}"
        return 0
    fi
    mkdir -p "$(dirname "$CHECKPOINT_PATH")" "$TENSORBOARD_LOGS_PATH"
    exec "${command[@]}"
}
