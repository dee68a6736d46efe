"""Data: megatron-core's GPT datasets addressed by microbatch id (`datasets.py`), the offline
tokenizers (`tokenizers.py`), and the ledger audit's dataset side (`audit.py`)."""
