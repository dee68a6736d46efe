"""Effective training time ratio (ETTR) and goodput, against allocated capacity.

Goodput is committed tokens per allocated process-second. A process counts as allocated from
the moment the job holds it until it is released: a dead process counts until it is replaced
(for ever, when nothing replaces it), and a standby counts while it waits. ETTR divides goodput
by the failure-free goodput of the same job (its tokens per process-second with every process
training), so 1.0 means no capacity was lost to failures, checkpoints or standbys.

Committed tokens are what the job kept: an iteration a restart redoes counts once, and a
drop-and-go iteration counts only the microbatches it committed.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    """Processes held over [start_s, end_s]: `steps` are (time, processes held from then on),
    in time order, the first at start_s."""

    start_s: float
    end_s: float
    steps: tuple[tuple[float, int], ...]

    @classmethod
    def constant(cls, processes: int, start_s: float, end_s: float) -> "Allocation":
        return cls(start_s, end_s, ((start_s, processes),))

    def __post_init__(self):
        if not self.steps or self.steps[0][0] != self.start_s:
            raise ValueError("Allocation: the first step must be at start_s")
        if any(b[0] < a[0] for a, b in zip(self.steps, self.steps[1:])):
            raise ValueError("Allocation: steps must be in time order")
        if self.end_s < self.start_s:
            raise ValueError("Allocation: end_s before start_s")

    def process_seconds(self) -> float:
        edges = [t for t, _ in self.steps] + [self.end_s]
        return sum((min(b, self.end_s) - a) * n
                   for (a, n), b in zip(self.steps, edges[1:]) if a < self.end_s)


def goodput(committed_tokens: float, allocation: Allocation) -> float:
    """Committed tokens per allocated process-second."""
    seconds = allocation.process_seconds()
    if seconds <= 0:
        raise ValueError("goodput: the allocation holds no process-seconds")
    return committed_tokens / seconds


def ettr(committed_tokens: float, allocation: Allocation,
         failure_free_tokens_per_process_s: float) -> float:
    """Goodput over the failure-free goodput of the same job."""
    if failure_free_tokens_per_process_s <= 0:
        raise ValueError("ettr: the failure-free rate must be positive")
    return goodput(committed_tokens, allocation) / failure_free_tokens_per_process_s
