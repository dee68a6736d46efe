"""Deterministic fault injection for tests and the failure simulator.

A fault is "rank R dies (or stalls) the N-th time it reaches point P" (counting from when the
injector is armed, or from the start for `before`):
  before     just before the N-th collective the caller announces with `injector.before()`
  reduce     inside the N-th ulfm all-reduce, after it was posted
  consensus  inside the N-th consensus agreement, after it was posted
  shrink     while the N-th shrink of a repair is in progress (killed from a timer after delay_s)
Spec strings: "RANK:POINT[:N][@DELAY_S]" for a kill, "RANK:delay-POINT[:N]@SECONDS" for a stall
before entering (used to hold a survivor back so a collective cannot finish before the kill).

The victim appends a JSON line {"point", "rank", "time"} to the marker file right before it kills
itself, so tests count kills that really happened.
"""

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

POINTS = ("before", "reduce", "consensus", "shrink", "broadcast-chunk", "allgather-chunk",
          "broadcast", "allgather", "reconfigure")
# The group's own points (`arm_fault`); `reconfigure` exists on the torch data plane only.
NATIVE_POINTS = ("reduce", "consensus", "shrink", "broadcast-chunk", "allgather-chunk",
                 "broadcast", "allgather", "reconfigure")


@dataclass(frozen=True)
class Fault:
    rank: int
    point: str
    occurrence: int = 1
    action: str = "kill"  # or "delay"
    delay_s: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        body, _, delay = spec.partition("@")
        parts = body.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"fault '{spec}': expected RANK:POINT[:N][@DELAY_S]")
        point, action = parts[1], "kill"
        if point.startswith("delay-"):
            point, action = point[len("delay-"):], "delay"
        if point not in POINTS:
            raise ValueError(f"fault '{spec}': point must be one of {', '.join(POINTS)}")
        fault = cls(rank=int(parts[0]), point=point,
                    occurrence=int(parts[2]) if len(parts) == 3 else 1,
                    action=action, delay_s=float(delay) if delay else 0.0)
        if fault.occurrence < 1:
            raise ValueError(f"fault '{spec}': occurrence counts from 1")
        if point == "shrink" and action == "kill" and fault.delay_s <= 0:
            raise ValueError(f"fault '{spec}': a kill inside shrink needs @DELAY_S > 0")
        return fault


def write_marker(marker_path: Path, point: str, rank: int, fields: dict | None = None) -> None:
    line = json.dumps({"point": point, "rank": rank, "time": time.time(), **(fields or {})}) + "\n"
    fd = os.open(marker_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_markers(marker_path: Path) -> list[dict]:
    if not Path(marker_path).exists():
        return []
    return [json.loads(line) for line in Path(marker_path).read_text().splitlines() if line]


class FaultInjector:
    """The faults of one rank. `arm(group)` hands the native points to a ulfm group."""

    def __init__(self, faults: list[Fault], rank: int, marker_path: Path):
        self.faults = [f for f in faults if f.rank == rank]
        self.rank = rank
        self.marker_path = Path(marker_path)
        self._before_count = 0

    def arm(self, group) -> None:
        """Native points count from now: occurrence N is the N-th time after this call."""
        for f in self.faults:
            if f.point in NATIVE_POINTS:
                group.arm_fault(f.point, group.fault_hits(f.point) + f.occurrence, f.action,
                                f.delay_s, str(self.marker_path))

    def before(self) -> None:
        """Call right before each collective the test counts; may stall or kill this rank."""
        self._before_count += 1
        for f in self.faults:
            if f.point == "before" and f.occurrence == self._before_count:
                if f.action == "delay":
                    time.sleep(f.delay_s)
                else:
                    write_marker(self.marker_path, "before", self.rank)
                    os.kill(os.getpid(), signal.SIGKILL)
