"""Progress output, written by the lowest live rank (rank 0 of the repaired cross-replica group,
position 0 of its replica), so it goes on when the rank that wrote it so far dies:

- Megatron-LM's iteration line every --log-interval iterations (`IntervalStats`): the elapsed
  time per iteration and the lm loss averaged over the interval, the skipped and NaN iteration
  counts of the interval, this iteration's learning rate, batch size, loss scale and grad norm,
  TFLOP/s per rank with --log-throughput; then ours: live replicas, contributions/B, failures;
- a line for each failure, when it happens;
- one JSON record per iteration (`RecoverLog`, --recover-log).

Every rank keeps the statistics (they come from agreed values), so a new writer continues the
interval where the old one left it.
"""

import json
import math
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path


def timestamp() -> str:
    """A line's time, as Megatron-LM's training_log writes it (to the microsecond)."""
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


class IntervalStats:
    """Megatron-LM's training_log bookkeeping between two iteration lines."""

    def __init__(self):
        self.failures = 0  # replicas lost so far (the whole run)
        self.evicted = 0  # of them, evicted by sampled verification
        self.evicted_nonfinite = 0  # of them, evicted after a non-finite gradient's reruns
        self.evicted_slow = 0  # of them, evicted as stragglers (--recover-evict-slower-than)
        self.restart()

    def restart(self) -> None:
        """Start a new interval (after each iteration line)."""
        self.iterations = 0
        self.elapsed_ms = 0.0
        self.loss_sum = 0.0
        self.aux_sums: dict[str, float] = {}  # MoE auxiliary losses, in the order first seen
        self.advanced = 0
        self.skipped = 0
        self.nan = 0

    def add(self, loss: float, skipped: bool, iteration_ms: float, lost_replicas: int = 0,
            aux_losses: dict[str, float] | None = None) -> None:
        """One iteration. As Megatron-LM, the loss of a skipped step is not averaged; a skipped
        step whose loss is inf or NaN also counts as a NaN iteration. The MoE auxiliary losses
        are summed over every iteration (Megatron-LM's track_moe_metrics) and divided by the
        advanced ones."""
        self.iterations += 1
        self.elapsed_ms += iteration_ms
        self.failures += lost_replicas
        for name, value in (aux_losses or {}).items():
            self.aux_sums[name] = self.aux_sums.get(name, 0.0) + value
        if skipped:
            self.skipped += 1
            self.nan += int(not math.isfinite(loss))
        else:
            self.loss_sum += loss
            self.advanced += 1

    def line(self, *, iteration: int, train_iters: int, consumed_samples: int, lr: float,
             global_batch_size: int, loss_scale: float, grad_norm: float | None,
             flops: float | None = None, ranks: int = 1, recover: dict | None = None,
             restart: bool = True) -> str:
        """The iteration line (then, `restart`, the interval starts again). `flops`: the
        iteration's model FLOPs with --log-throughput; `ranks`: the ranks that ran it;
        `recover`: our fields."""
        ms = self.elapsed_ms / max(self.iterations, 1)
        line = (f" [{timestamp()}] iteration {iteration:8d}/{train_iters:8d} |"
                f" consumed samples: {consumed_samples:12d} |"
                f" elapsed time per iteration (ms): {ms:.1f} |")
        if flops is not None:
            tflops = flops / (ms / 1e3 * 1e12 * ranks)
            # Megatron-LM's one decimal; a model this machine's CPUs train needs more digits.
            shown = f"{tflops:.1f}" if tflops >= 0.1 else f"{tflops:.2e}"
            line += f" throughput per GPU (TFLOP/s/GPU): {shown} |"
        line += f" learning rate: {lr:.6E} | global batch size: {global_batch_size:5d} |"
        if self.advanced:
            line += f" lm loss: {self.loss_sum / self.advanced:.6E} |"
        for name, total in self.aux_sums.items():
            if total / max(self.advanced, 1) > 0.0:  # as Megatron-LM: only positive averages
                line += f" {name}: {total / max(self.advanced, 1):.6E} |"
        line += f" loss scale: {loss_scale:.1f} |"
        if grad_norm is not None:
            line += f" grad norm: {grad_norm:.3f} |"
        line += (f" number of skipped iterations: {self.skipped:3d} |"
                 f" number of nan iterations: {self.nan:3d} |")
        if recover is not None:
            line += (f" live replicas: {recover['live replicas']} |"
                     f" contributions: {recover['contributions']}/{recover['B']} |"
                     f" failures: {self.failures} |")
            if "verified microbatches" in recover:
                line += (f" verified microbatches: {recover['verified microbatches']} |"
                         f" evicted for corruption: {self.evicted} |")
            if "non-finite reruns" in recover:
                line += (f" non-finite reruns: {recover['non-finite reruns']} |"
                         f" evicted for non-finite: {self.evicted_nonfinite} |")
            if "slow replicas" in recover:
                line += (f" microbatches per replica: {recover['microbatches per replica']} |"
                         f" slow replicas: {recover['slow replicas']} |"
                         f" evicted as stragglers: {self.evicted_slow} |")
        if restart:
            self.restart()
        return line


def failure_lines(iteration: int, events: list[dict]) -> list[str]:
    """One line per failure of an iteration, as it is repaired."""
    lines = []
    for event in events:
        if event["event"] == "join":
            lines.append(f" [{timestamp()}] iteration {iteration:8d}:"
                         f" replica(s) {event['replicas']} rejoined on standby ranks "
                         f"{event['ranks']}, epoch {event['epoch']}, state received "
                         f"{event['state_received'] - event['called']:.2f} s after the call")
        if event["event"] == "mismatch":
            lines.append(f" [{timestamp()}] iteration {iteration:8d}:"
                         f" gradient fingerprints differ for the first pass of replica(s) "
                         f"{event['owners']} against checker(s) {event['checkers']}: arbitrated "
                         f"by replica(s) {event['arbiters']}")
        if event["event"] == "corruption":
            lines.append(f" [{timestamp()}] iteration {iteration:8d}:"
                         f" replica(s) {event['evicted']} computed gradients two other replicas "
                         "contradict: evicted before the commit (silent data corruption)")
        if event["event"] == "nonfinite":
            lines.append(f" [{timestamp()}] iteration {iteration:8d}:"
                         f" replica(s) {event['replicas']} held out a non-finite gradient: "
                         f"rerun in place and by replica(s) {event['checkers']}")
        if event["event"] == "straggler":
            lines.append(f" [{timestamp()}] iteration {iteration:8d}:"
                         f" replica(s) {event['evicted']} evicted as stragglers: "
                         + ", ".join(f"replica {r} {x:.2f}x" for r, x in event["ratios"].items())
                         + f" the other replicas' median time per microbatch for "
                         f"{event['window']} iterations; they leave after this step")
        if event["event"] == "rerun":
            lines.append(f" [{timestamp()}] iteration {iteration:8d}:"
                         " non-finite gradient classified "
                         + ", ".join(f"replica {r}: {o}" for r, o in event["outcomes"].items())
                         + f"; evicted {event['evicted']}, kept {event['kept']}")
        if event["event"] != "failure":
            continue
        # The ranks this position's group saw fail; another position of the replica may have
        # seen the failure first (the replica verdict then names only the replicas).
        ranks = f" (ranks {event['ranks']})" if event["ranks"] else ""
        line = (f" [{timestamp()}] iteration {iteration:8d}:"
                f" replica(s) {event['replicas']} lost{ranks}, epoch {event['epoch']}, ")
        if event.get("during") == "evaluation":
            line += "during the evaluation after it: evaluated again by the survivors"
        elif event.get("during") == "join":
            line += "while standbys joined after it: left out of the layout"
        else:
            line += f"{event['restore']} restore"
            if event["g_ext"]:
                line += f", extension pass of {event['g_ext']}"
            if event["promotions"]:
                line += f", promoted {event['promotions']}"
        lines.append(line)
    return lines


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
