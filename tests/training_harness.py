"""Shared by the end-to-end training tests: run pretrain_gpt_recover.py bounded, read what the
ranks wrote, and compare a run with its failure-free reference.

"Exact" (docs/design.md, "Exact semantics") is checked two ways, both against the failure-free
run of the same command: the loss of every iteration within EXACT_LOSS_RTOL relative, and every
surviving rank's final parameters within EXACT_PARAM_RTOL (max abs difference over the tensor,
relative to the reference tensor's max abs). Measured on the tiny test GPTs at lr 3e-3 with
clipping: ~1e-8 for both; a lost or doubled microbatch gradient moves them by far more (the
negative controls).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_recover.faults import read_markers
from megatron_recover.launch import LaunchConfig, RunResult, launch
from megatron_recover.testing.compare import (  # noqa: F401  (the tests import them from here)
    EXACT_RTOL,
    STABLE_LR,
    loss_rdiff,
    param_rdiff,
)
from tests.mpirun_harness import ENTRY

EXACT_LOSS_RTOL = EXACT_RTOL
EXACT_PARAM_RTOL = EXACT_RTOL


@dataclass
class TrainingRun:
    result: RunResult
    records: list[dict]  # the recovery log, one record per line
    markers: list[dict]  # the victims' markers
    status_dir: Path

    def params(self, rank: int) -> dict[str, torch.Tensor]:
        """`rank`'s final parameters (written by ranks that completed)."""
        return torch.load(self.status_dir / f"rank-{rank}.params.pt")

    def completed(self) -> list[int]:
        return sorted(r for r, s in self.result.statuses.items() if s.get("state") == "completed")


def printed_values(output: str, field: str) -> list[float]:
    """The numbers Megatron's progress lines print after `field:` ("lm loss" on iteration
    lines, "lm loss value" on validation lines), in the order printed."""
    return [float(line.split(f"{field}:")[1].split("|")[0]) for line in output.splitlines()
            if f"{field}:" in line]


def megatron_lm_lines(losses: dict[int, float], log_interval: int = 1) -> dict[int, float]:
    """What Megatron-LM's iteration lines print for one launch's per-iteration `losses`
    ({iteration: loss}, consecutive, the launch's first iteration first): a line on the first
    iteration and on each multiple of `log_interval`, each the mean of the losses since the last
    line that started a new interval, where the first iteration's line starts none
    (core_v0.19.0 training_log: `should_reset = not is_first_iteration`)."""
    lines, pending = {}, []
    for n, iteration in enumerate(sorted(losses)):
        pending.append(losses[iteration])
        if n == 0 or iteration % log_interval == 0:
            lines[iteration] = sum(pending) / len(pending)
            if n > 0:
                pending = []
    return lines


def run_training(run_dir: Path, num_ranks: int, args: list[str], schedule: str | None = None,
                 timeout_s: float = 300, entry: list[str] = ENTRY) -> TrainingRun:
    """`pretrain_gpt_recover.py ARGS --recover --recover-log ...` on `num_ranks` ranks, with an
    optional failure schedule (YAML text). Asserts that it did not hang and that it succeeded.
    `entry`: the command before ARGS (a user's own script instead of the entry point)."""
    run_dir.mkdir(parents=True)
    log = run_dir / "log.jsonl"
    extra = []
    if schedule is not None:
        (run_dir / "schedule.yaml").write_text(schedule)
        extra = ["--recover-failure-schedule", str(run_dir / "schedule.yaml")]
    result = launch(LaunchConfig(num_ranks, [*entry, *args, "--recover", "--recover-log", str(log),
                                             *extra], run_dir / "status", timeout_s))
    assert not result.timed_out, f"{run_dir.name}: hung\n{result.output[-4000:]}"
    assert result.succeeded, result.output[-4000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return TrainingRun(result, records, read_markers(log.with_suffix(".markers.jsonl")),
                       run_dir / "status")


def assert_exact(run: TrainingRun, reference: TrainingRun, label: str) -> tuple[float, float]:
    """Every iteration's loss and every completed rank's final parameters match the reference
    (same rank, so the same TP x PP position); returns (loss diff, parameter diff)."""
    loss = loss_rdiff(run.records, reference.records)
    survivors = run.completed()
    assert survivors, "no rank completed"
    params = max(param_rdiff(run.params(r), reference.params(r)) for r in survivors)
    print(f"{label}: max relative loss diff {loss:.2e}, final parameters {params:.2e} "
          f"(ranks {survivors})")
    assert loss <= EXACT_LOSS_RTOL, f"{label}: loss differs by {loss:.2e}"
    assert params <= EXACT_PARAM_RTOL, f"{label}: parameters differ by {params:.2e}"
    return loss, params


def assert_ledger_held(records: list[dict], b: int) -> None:
    """One record per iteration, each committing B gradients with the ledger invariant held."""
    bad = [(r["iteration"], r["contributions"], r["ledger_problems"]) for r in records
           if not (r["invariant_ok"] and r["contributions"] == r["B"] == b)]
    assert not bad, f"ledger invariant violated: {bad}"
