"""megatron-recover: in-step recovery for Megatron pre-training (the ReCoVer design).

Layers, importing downward only:
  collective/  layer 1: the `ulfm` torch.distributed backend and its failure records
  recovery/    layer 2: epoch-tagged bucket snapshots, rewind and re-reduce
  policy/      layer 3: versatile workload (roles, exact microbatch assignment); pure Python
  megatron/    the glue that our patches to megatron-core call
Importing the package has no side effects: the exit discipline of a ULFM run is installed by
`megatron_recover.runtime.install_exit_discipline()` when a distributed run is initialized.
"""

__version__ = "0.1.0"
