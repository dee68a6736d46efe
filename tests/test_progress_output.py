"""The iteration line's bookkeeping, the model FLOPs behind --log-throughput, and a TensorBoard
writer taking over from one that died (single process, no MPI)."""

import math
from dataclasses import dataclass
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_recover.megatron.app.report import IntervalStats
from megatron_recover.megatron.config.mcore_config import model_flops
from megatron_recover.megatron.app.writers import MetricWriters


def test_interval_averages_and_counts_as_megatron():
    stats = IntervalStats()
    stats.add(4.0, False, 100.0)
    stats.add(float("nan"), True, 300.0)  # skipped with a NaN loss: not averaged, counted
    stats.add(2.0, False, 200.0, lost_replicas=1)
    line = stats.line(iteration=3, train_iters=9, consumed_samples=24, lr=1e-3,
                      global_batch_size=8, loss_scale=1.0, grad_norm=0.5,
                      recover={"live replicas": 3, "contributions": 8, "B": 8})
    assert "elapsed time per iteration (ms): 200.0 |" in line
    assert "lm loss: 3.000000E+00 |" in line
    assert "number of skipped iterations:   1 | number of nan iterations:   1 |" in line
    assert "live replicas: 3 | contributions: 8/8 | failures: 1 |" in line
    # A new interval; the failures are the run's.
    stats.add(1.0, False, 50.0)
    line = stats.line(iteration=4, train_iters=9, consumed_samples=32, lr=1e-3,
                      global_batch_size=8, loss_scale=1.0, grad_norm=None,
                      recover={"live replicas": 3, "contributions": 8, "B": 8})
    assert "elapsed time per iteration (ms): 50.0 |" in line and "grad norm" not in line
    assert "number of skipped iterations:   0 |" in line and "failures: 1 |" in line


@dataclass
class Model:
    seq_length: int = 4
    hidden_size: int = 8
    num_layers: int = 2
    num_attention_heads: int = 2
    num_query_groups: int | None = None
    kv_channels: int = 4
    ffn_hidden_size: int = 32
    swiglu: bool = False


def test_model_flops_counts_each_matmul():
    """Counted by hand for one sequence: per layer, QKV (3 h x h), attention output (h x h), the
    scores and the weighted values (s x h each per token, half of them under the causal mask),
    the MLP (2 h x f); then the logits (h x V); each multiply-add is 2 FLOPs forward and 4
    backward."""
    s, h, layers, f, vocab = 4, 8, 2, 32, 16
    per_token = layers * (3 * h * h + h * h + s * h + 2 * h * f) + h * vocab
    assert math.isclose(model_flops(Model(), vocab, batch_size=1), 6 * s * per_token)
    # Grouped queries shrink the key and value projections; SwiGLU adds a third of the MLP.
    gqa = Model(num_query_groups=1, swiglu=True)
    per_token = layers * (2 * h * h + 2 * h * (h // 2) + s * h + 3 * h * f) + h * vocab
    assert math.isclose(model_flops(gqa, vocab, batch_size=1), 6 * s * per_token)


@dataclass
class Logging:
    tensorboard_dir: Path
    tensorboard_queue_size: int = 10
    wandb_project: str | None = None


@dataclass
class Config:
    logging: Logging


def test_a_writer_that_takes_over_writes_each_step_once(tmp_path):
    cfg = Config(Logging(tmp_path / "tb"))
    first, second = MetricWriters(cfg, "run"), MetricWriters(cfg, "run")
    for step in (1, 2):
        for writers in (first, second):  # every rank keeps the values
            writers.add([("lm loss", float(step), step)])
        first.write(is_writer=True)
        second.write(is_writer=False)
    first.close()  # the first writer is gone after step 2; step 3 is the second's
    second.add([("lm loss", 3.0, 3)])
    second.write(is_writer=True)
    second.close()
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("lm loss")] == [
        (1, 1.0), (2, 2.0), (3, 3.0)]
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
