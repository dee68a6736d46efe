"""Test and demo support: `cpu_emulation` runs unmodified megatron-core where CUDA is absent."""

from megatron_recover.testing.cpu_emulation import (
    cpu_emulation_enabled,
    disable_cpu_emulation,
    enable_cpu_emulation,
    is_enabled,
    on_device,
)

__all__ = ["cpu_emulation_enabled", "disable_cpu_emulation", "enable_cpu_emulation", "is_enabled",
           "on_device"]
