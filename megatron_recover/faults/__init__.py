"""Failure injection: kill or stall ranks at named points (tests, the simulator, the demo)."""

from megatron_recover.faults.injection import (
    NATIVE_POINTS,
    POINTS,
    Fault,
    FaultInjector,
    read_markers,
    write_marker,
)

__all__ = ["NATIVE_POINTS", "POINTS", "Fault", "FaultInjector", "read_markers", "write_marker"]
