"""The application: assembling a rank (`run.py`, `rank_setup.py`), the one training loop in
Megatron-LM's order (`loop.py`), what follows each iteration (`progress.py`, `report.py`,
`writers.py`, `evaluation.py`), and the training side of a standby join (`joins.py`)."""
