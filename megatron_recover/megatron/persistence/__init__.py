"""What outlives a process: a rank's complete training state (`training_state.py`), checkpoints
in Megatron-LM's formats (`torch_format.py`, `torch_dist.py`, with `common.py` and the load plan
of `loading.py`), and in-memory node snapshots (`snapshots.py`)."""
