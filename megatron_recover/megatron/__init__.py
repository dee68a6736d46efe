"""The glue between megatron-core and the recovery layers: what our patches and
pretrain_gpt_recover.py call. `hooks` is imported by patched megatron-core and imports nothing
of megatron; the other modules import megatron-core."""
