"""TensorBoard (--tensorboard-dir) and Weights & Biases (--wandb-project) values, with
Megatron-LM's tags, written by the lowest live rank.

Every rank computes each logged iteration's values (`training_scalars`, `validation_scalars`:
agreed values only) and keeps them until it has seen them written; only the writer writes. When
the writer dies the next lowest live rank takes over. It opens its own event file in the same
directory (TensorBoard reads every file there) and first reads what the files already hold, so
it writes each (tag, step) exactly once: the dead writer's last values, if they never reached the
file, come from the new writer's own copy. The writer flushes after every logged iteration, so a
writer killed at any moment loses nothing it had written.
"""

from collections import deque
from pathlib import Path

PENDING = 1000  # logged iterations a rank keeps until it sees them written

# Ours, besides Megatron-LM's.
OUR_TAGS = ("live replicas", "failures", "recovery seconds")
VERIFICATION_TAGS = ("verified microbatches", "evicted for corruption")  # with the check on
RERUN_TAGS = ("non-finite reruns", "evicted for non-finite")  # with --recover-nonfinite-rerun
# With straggler handling: how many replicas the next layout treats as slow, evictions so far.
STRAGGLER_TAGS = ("slow replicas", "evicted as stragglers")


def training_scalars(cfg, *, iteration: int, consumed_samples: int, lr: float,
                     global_batch_size: int, loss: float, loss_scale: float,
                     grad_norm: float | None, iteration_s: float, throughput: float | None,
                     live_ranks: int, recover: dict | None) -> list[tuple[str, float, int]]:
    """(tag, value, step) of one iteration, as Megatron-LM's training_log writes them: each
    value at the iteration, and the "vs samples" variant at the consumed samples."""
    log = cfg.logging
    values = [("learning-rate", lr), ("batch-size", global_batch_size), ("lm loss", loss)]
    if log.log_loss_scale:
        values.append(("loss-scale", loss_scale))
    if log.log_world_size:
        values.append(("world-size", live_ranks))
    if grad_norm is not None:
        values.append(("grad-norm", grad_norm))
    scalars = []
    for tag, value in values:
        scalars += [(tag, float(value), iteration),
                    (f"{tag} vs samples", float(value), consumed_samples)]
    if log.log_timers:
        scalars.append(("iteration-time", iteration_s, iteration))
        if throughput is not None:
            scalars.append(("throughput", throughput, iteration))
    if recover is not None:
        scalars += [(tag, float(recover[tag]), iteration)
                    for tag in OUR_TAGS + VERIFICATION_TAGS + RERUN_TAGS + STRAGGLER_TAGS
                    if tag in recover]
    return scalars


def moe_scalars(cfg, iteration: int, aux_losses: dict) -> list[tuple[str, float, int]]:
    """Megatron-LM's track_moe_metrics tags: each auxiliary loss under its name and, with
    --moe-per-layer-logging, each layer's under "moe/NAME_layer_I" (0-based, every layer)."""
    scalars = []
    for name, (value, layers) in aux_losses.items():
        scalars.append((name, float(value), iteration))
        if cfg.model.moe.per_layer_logging:
            scalars += [(f"moe/{name}_layer_{i}", float(v), iteration)
                        for i, v in enumerate(layers)]
    return scalars


def validation_scalars(cfg, result, consumed_samples: int) -> list[tuple[str, float, int]]:
    """Megatron-LM's evaluate_and_print_results tags for one evaluation."""
    values = [("lm loss validation", result.loss)]
    if cfg.logging.log_validation_ppl:
        values.append(("lm loss validation ppl", result.ppl))
    scalars = []
    for tag, value in values:
        scalars += [(tag, float(value), result.iteration),
                    (f"{tag} vs samples", float(value), consumed_samples)]
    return scalars


class MetricWriters:
    """The run's TensorBoard and W&B sinks on every rank; `write` does so on the writer only."""

    def __init__(self, cfg, run_id: str):
        self.cfg = cfg
        self.run_id = run_id  # the same on every rank: the W&B run a new writer resumes
        self.pending: deque = deque(maxlen=PENDING)
        self._tensorboard = None
        self._wandb = None
        self._written: set[tuple[str, int]] = set()

    @property
    def enabled(self) -> bool:
        log = self.cfg.logging
        return log.tensorboard_dir is not None or log.wandb_project is not None

    def add(self, scalars: list[tuple[str, float, int]]) -> None:
        """Values every rank computed; the writer writes them at its next `write`."""
        if self.enabled and scalars:
            self.pending.append(scalars)

    def write(self, is_writer: bool) -> None:
        """On the writer, write what is pending and flush; everyone then forgets it (a rank that
        becomes the writer later first reads what is in the files)."""
        if not is_writer:
            return
        if self.enabled:
            self._open()
            for scalars in self.pending:
                for tag, value, step in scalars:
                    if (tag, step) in self._written:
                        continue
                    self._written.add((tag, step))
                    if self._tensorboard is not None:
                        self._tensorboard.add_scalar(tag, value, step)
                    if self._wandb is not None and not tag.endswith(" vs samples"):
                        self._wandb.log({tag: value}, step=step)
            if self._tensorboard is not None:
                self._tensorboard.flush()
        self.pending.clear()

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()

    def _open(self) -> None:
        log = self.cfg.logging
        if log.tensorboard_dir is not None and self._tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self._written |= written_scalars(log.tensorboard_dir)
            self._tensorboard = SummaryWriter(log_dir=str(log.tensorboard_dir),
                                              max_queue=log.tensorboard_queue_size)
        if log.wandb_project is not None and self._wandb is None:
            import wandb

            save_dir = log.wandb_save_dir or str(Path(self.cfg.checkpoint.save or ".") / "wandb")
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(project=log.wandb_project, name=log.wandb_exp_name or None,
                                     entity=log.wandb_entity or None, dir=save_dir,
                                     id=self.run_id, resume="allow")


def written_scalars(directory: Path) -> set[tuple[str, int]]:
    """(tag, step) of every scalar in the event files of `directory` (none if it is new)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    written = set()
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                written.add((value.tag, event.step))
    return written
