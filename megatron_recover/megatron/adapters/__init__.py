"""megatron-core behind the round's interfaces: the functions our patches call (`hooks.py`), the
trainer's parts over megatron's DDP, schedule and optimizer (`trainer_parts.py`), the GPT model
and its microbatch pass (`gpt.py`, `norms.py`, `interleaving.py`, `moe_losses.py`), and a rank's
device and groups (`devices.py`, `groups.py`)."""
