"""The glue between megatron-core and the recovery layers, by role: `adapters/` (what our patches
call, and megatron-core behind the round's interfaces), `config/` (Megatron's arguments and the
run's configuration), `data/`, `persistence/` (training state, checkpoints, snapshots, resume)
and `app/` (assembling a rank, the training loop). `adapters/hooks.py` is imported by patched
megatron-core and imports nothing of megatron; most other modules import megatron-core."""
