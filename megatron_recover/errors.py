"""What an error raised on a rank means for the job: one classification, used by the exit hook
(`runtime`) on every thread of every rank. docs/failures.md says the same for users.

  lost peer   `CollectiveTimeout` (a ulfm wait outlived the hang bound), torch.distributed's own
              error types (`DistError`: DistBackendError, DistNetworkError, DistStoreError),
              an MPI error whose class says a process failed or the communicator was revoked
              (ULFM's MPI_ERR_PROC_FAILED, _PENDING, MPI_ERR_REVOKED: raised at start-up, before
              any repair is in place, by a call that met a dead rank), or any error raised
              while MPI's failure detector reports a peer of this rank's replica failed (the
              runtime asks MPI; gloo says so only in its message text, which is never read),
              or EIO/EPIPE on a write (mpirun is gone: the job is being torn down). The
              replica is gone anyway: the rank leaves (SIGKILL, status `left`) and
              the survivors absorb the replica in-step.
  device      a fault of this rank's device raised into Python: `torch.AcceleratorError` (how
              CUDA errors such as an illegal address, an ECC or an Xid error reach Python) or
              `DeviceFault` (the failure schedule's `device-error` action). The same microbatch
              gives the same gradient on a healthy device: the rank leaves as a failed one and
              the survivors absorb it in-step.
  program     anything else: an error of the program or of the data (a bug in a layer, a sample
              that breaks the tokenizer, a shape mismatch, an out-of-memory at one batch shape).
              It recurs on every replica that runs the same microbatch, so taking the rank down
              would make the survivors rerun it and fall one after another: under `--recover`
              the rank ends the whole job at once, with the traceback, the iteration and the
              microbatch id, by stopping its Open MPI daemon (MPI_Abort kills the caller alone
              under ULFM, and the survivors would absorb that); `megatron-recover launch` then
              exits with PROGRAM_ERROR_EXIT and does not relaunch.

`--recover-program-errors survive` treats program errors as failures of the rank instead (for a
job that knows its errors are not deterministic).
"""

from __future__ import annotations

import errno
import sys

from megatron_recover.collective.records import CollectiveTimeout

PEER_LOST = "lost peer"
DEVICE = "device"
PROGRAM = "program"
KINDS = (PEER_LOST, DEVICE, PROGRAM)

ABORT, SURVIVE = "abort", "survive"  # --recover-program-errors
PROGRAM_ERROR_EXIT = 3  # megatron-recover launch's exit status when a program error ended the job

_where: dict = {}  # the iteration and microbatch this rank is running (`note`)


class DeviceFault(RuntimeError):
    """A device fault raised into Python by our own code (the failure schedule's
    `device-error` action raises it as torch raises torch.AcceleratorError)."""


class NonFiniteResult(DeviceFault):
    """A NaN or inf gradient-bucket norm found on this rank before the data-parallel reduction
    while the microbatch losses were finite (Megatron's check_for_nan_in_loss_and_grad). Taken
    for a fault of this replica's device: under --recover the rank leaves and the other
    replicas redo its microbatches in the same iteration, so the bad numbers reach no other
    replica (docs/failures.md)."""


class SilentCorruption(DeviceFault):
    """Sampled verification found this replica's gradient of some microbatches different from
    what two other replicas computed for the same ids (`recovery.verification`): its device is
    taken for faulty, the rank leaves before the commit and the survivors redo its microbatches
    in the same iteration (docs/verification.md)."""


class Straggler(DeviceFault):
    """With --recover-evict-slower-than: this replica's measured compute time per microbatch
    stayed past that factor over the other replicas' median for a window of iterations. Its
    device is taken for failing slowly: the rank leaves after the step, as a failed one, and
    the survivors go on without it (a standby, if any, takes its id) (`policy.speed`)."""


class UnresolvedCorruption(RuntimeError):
    """Two replicas computed different gradients for the same microbatches and no third one
    could tell which is right (none was left, or all three differ): nothing of the iteration is
    committed and the job ends, on every rank, with the iteration, the replicas and the ids."""


class NonFiniteData(RuntimeError):
    """With --recover-nonfinite-rerun: microbatches whose gradient was non-finite on one replica
    gave a non-finite gradient again when it reran them and when another replica ran them (or
    no other replica was left to run them). The fault is in the data or the model's state, not
    in a device: a program error, which ends the job with the iteration, the microbatch ids and
    their samples, nothing of the iteration committed (`recovery.rerun`)."""


class NonFiniteLoss(RuntimeError):
    """A NaN or inf microbatch loss (the same check, in the forward). The forward is a
    deterministic function of the parameters, equal on every replica, and of the microbatch:
    such a loss recurs wherever the microbatch runs, so it is a program error (of the data or
    of the model's state) and, under --recover, ends the job with its iteration and microbatch
    (`--recover-program-errors survive` takes it for a failure of the rank instead)."""


def _kind_of(exc: BaseException) -> str | None:
    import torch  # not at import: the launcher's command line reads this module too
    import torch.distributed as dist

    if isinstance(exc, CollectiveTimeout) or isinstance(exc, dist.DistError):
        return PEER_LOST
    mpi = sys.modules.get("mpi4py.MPI")  # only a rank that started MPI can have raised one
    if mpi is not None and isinstance(exc, mpi.Exception) and exc.Get_error_class() in (
            mpi.ERR_PROC_FAILED, mpi.ERR_PROC_FAILED_PENDING, mpi.ERR_REVOKED):
        return PEER_LOST
    if isinstance(exc, OSError) and exc.errno in (errno.EIO, errno.EPIPE):
        # The rank's terminal is gone: mpirun died (a lost node tears the job down, and the
        # ranks on mpirun's node then fail to write: docs/node-loss.md). Nothing to end.
        return PEER_LOST
    accelerator_error = getattr(torch, "AcceleratorError", DeviceFault)
    if isinstance(exc, (DeviceFault, accelerator_error)):
        return DEVICE
    return None


def classify(exc: BaseException, peer_failed=lambda: False) -> str:
    """The kind of `exc` (or of an exception it was raised from). `peer_failed()`, asked only
    when no typed kind is found: whether MPI reports a peer of this rank's replica failed."""
    seen = set()
    cause = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        kind = _kind_of(cause)
        if kind is not None:
            return kind
        cause = cause.__cause__ or cause.__context__
    return PEER_LOST if peer_failed() else PROGRAM


def note(iteration: int | None, microbatch_id: int | None = None) -> None:
    """This rank now runs `microbatch_id` of `iteration` (None: between microbatches)."""
    _where["iteration"] = iteration
    _where["microbatch_id"] = microbatch_id


def where() -> dict:
    """{"iteration", "microbatch_id"} of the last `note` (values None when unknown)."""
    return {"iteration": _where.get("iteration"), "microbatch_id": _where.get("microbatch_id")}


def describe(place: dict) -> str:
    """`where()` in words."""
    if place["iteration"] is None:
        return "outside the training iterations"
    if place["microbatch_id"] is None:
        return f"in iteration {place['iteration']}, outside a microbatch's forward and backward"
    return f"in iteration {place['iteration']}, microbatch {place['microbatch_id']}"
