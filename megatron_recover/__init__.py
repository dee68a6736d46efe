"""megatron-recover: in-step recovery for Megatron pre-training (the ReCoVer design).

The import graph, downward only (tests/unit/test_import_rules.py holds it, with no cycle):
  collective/  layer 1: the `ulfm` torch.distributed backend and its failure records
  recovery/    layer 2: the round core (round.py) and its registered checks (checks/),
               epoch-tagged bucket snapshots, rewind and re-reduce, the ledger, the protocol
               state; between iterations, membership (membership/: standbys, state transfer)
  policy/      layer 3: versatile workload (roles, exact microbatch assignment), pure Python:
               the leaf the round consults, importing nothing of ours above it
  megatron/    the glue, by role: data/, adapters/ (what our patches call, megatron-core behind
               the round's interfaces), config/, persistence/, app/ (assembling a rank, the loop)
  runtime, launch, relaunch, launch_cli, cli: the entry points; faults/, goodput/, testing/:
  fault injection, the goodput model, the unit tier's fakes; errors, hang, mpi: small shared
  definitions below their users.
Importing the package has no side effects: the exit discipline of a ULFM run is installed by
`megatron_recover.runtime.install_exit_discipline()` when a distributed run is initialized.
"""

__version__ = "0.1.0"
