"""Megatron's arguments and the run's configuration: the parser and its start-up validation
(`arguments.py`, `moe_arguments.py`), the status of every Megatron-LM argument
(`argument_table.py`), the validated `TrainConfig` (`train_config.py`) and megatron-core's
config objects built from it (`mcore_config.py`)."""
