"""Shared by the multi-process tests: run a worker script under mpirun --with-ft ulfm, bounded.

Each run starts mpirun in its own process group and kills that group on timeout (never anything
else), and returns what the ranks wrote, since mpirun's exit status says nothing about failures.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_recover.faults import read_markers
from megatron_recover.launch import LaunchConfig, launch

WORKERS = Path(__file__).parent / "mpi"


@dataclass
class MPIRun:
    results: dict[int, dict]
    markers: list[dict]
    output: str
    timed_out: bool
    elapsed_s: float


def run_worker(tmp_path: Path, worker: str, num_ranks: int, args: list[str],
               timeout_s: float) -> MPIRun:
    """Run tests/mpi/WORKER with `args` after (OUT_DIR, MARKER); collect result-RANK.json files."""
    marker = tmp_path / "markers.jsonl"
    cfg = LaunchConfig(num_ranks=num_ranks,
                       command=[sys.executable, str(WORKERS / worker), *args[:1], str(tmp_path),
                                str(marker), *args[1:]],
                       status_dir=tmp_path / "status", timeout_s=timeout_s)
    result = launch(cfg)
    results = {}
    for path in tmp_path.glob("result-*.json"):
        data = json.loads(path.read_text())
        results[data["rank"]] = data
    return MPIRun(results, read_markers(marker), result.output, result.timed_out,
                  result.elapsed_s)

ENTRY = [sys.executable, str(Path(__file__).resolve().parent.parent / "pretrain_gpt_recover.py")]
