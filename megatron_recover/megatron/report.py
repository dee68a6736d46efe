"""Progress output: Megatron-style iteration lines on the console, one JSON record per iteration.

Both are written by the lowest live rank (rank 0 of the repaired cross-replica group), so the log
goes on when the rank that wrote it so far dies.
"""

import json
import time
from dataclasses import asdict
from pathlib import Path


def iteration_line(report, train_iters: int, consumed_samples: int, lr: float,
                   global_batch_size: int) -> str:
    grad_norm = "n/a" if report.grad_norm is None else f"{report.grad_norm:.3f}"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    line = (f" [{stamp}] iteration {report.iteration:8d}/{train_iters:8d} |"
            f" consumed samples: {consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {report.iteration_ms:.1f} |"
            f" learning rate: {lr:.6E} | global batch size: {global_batch_size:5d} |"
            f" lm loss: {report.loss:.6E} | loss scale: {report.loss_scale:.1f} |"
            f" grad norm: {grad_norm} |")
    if report.skipped:
        line += " skipped (inf/nan gradient) |"
    line += (f" live replicas: {report.live_replicas} |"
             f" contributions: {report.contributions}/{report.B} |")
    for event in report.events:
        if event["event"] == "failure":
            line += (f"\n     replica(s) {event['replicas']} lost (ranks {event['ranks']}),"
                     f" epoch {event['epoch']}, {event['restore']} restore")
            if event["g_ext"]:
                line += f", extension pass of {event['g_ext']}"
            if event["promotions"]:
                line += f", promoted {event['promotions']}"
    return line


class RecoverLog:
    """Appends one JSON object per committed iteration to `path` (JSONL), with `time`: the
    writer's wall clock (time.time()) once the iteration committed and the optimizer stepped."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, report, **extra) -> None:
        if self.path is None:
            return
        record = {**asdict(report), "time": time.time(), **extra}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def write_missing(self, report, **extra) -> None:
        """Taking over from a writer that died: drop the line it may have left half-written,
        then write `report` unless the log already has its iteration."""
        if self.path is None or not self.path.exists():
            return self.write(report, **extra)
        text = self.path.read_text()
        complete = text[:text.rfind("\n") + 1]
        if complete != text:
            self.path.write_text(complete)
        lines = complete.splitlines()
        if not lines or json.loads(lines[-1])["iteration"] < report.iteration:
            self.write(report, **extra)
