"""mpi4py as every module of ours imports it, and what a communicator knows of failed ranks.

Imports nothing of ours and nothing heavy: the entry points use it before torch is loaded."""


def mpi():
    """mpi4py's MPI module. Our exit path decides whether MPI_Finalize is safe after a failure
    (it can hang: docs/ulfm-behaviour.md), so mpi4py must not call it at exit."""
    import mpi4py

    mpi4py.rc.finalize = False
    from mpi4py import MPI

    return MPI


def failed_ranks(comm) -> set[int]:
    """The ranks of `comm` (an mpi4py communicator) this process knows to have failed."""
    MPI = mpi()
    failed_group = comm.Get_failed()
    failed = MPI.Group.Translate_ranks(failed_group, list(range(failed_group.Get_size())),
                                       comm.Get_group())
    failed_group.Free()
    return set(failed)
