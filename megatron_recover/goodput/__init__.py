"""Goodput: how much of an allocation turns into committed training.

`ettr` defines the figures against allocated capacity (one definition for the CPU benchmarks and
the simulator); `simulator` plays a long run of each fault-tolerance system against one seeded
failure trace; `anchors` checks the simulator against published figures; `cli` is
`megatron-recover goodput`. Pure Python: nothing here imports torch or MPI.
"""
