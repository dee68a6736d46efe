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

    def __init__(self, path: Path | None, last_written: int | None = None):
        """last_written: the iteration this run's log holds up to, when the caller knows it (the
        run's first writer: the iteration it starts after); None: read it from the log, for a
        writer taking over from one that died."""
        self.path = Path(path) if path else None
        self._last = last_written
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, report, **extra) -> None:
        if self.path is None:
            return
        record = {**asdict(report), "time": time.time(), **extra}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def write_missing(self, pending) -> None:
        """Write the (report, extra fields) of `pending`, oldest first, that the log does not
        have yet. The first call reads the log once: a writer that took over from one that died
        drops the line it may have left half-written, and the last complete record says which
        iterations are in; later calls know it."""
        if self.path is None:
            return
        if self._last is None:
            self._last = 0
            if self.path.exists():
                text = self.path.read_text()
                complete = text[:text.rfind("\n") + 1]
                if complete != text:
                    self.path.write_text(complete)
                lines = complete.splitlines()
                self._last = json.loads(lines[-1])["iteration"] if lines else 0
        for report, extra in pending:
            if report.iteration > self._last:
                self.write(report, **extra)
                self._last = report.iteration
