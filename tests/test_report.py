"""The recovery log's writer handover (megatron_recover/megatron/app/report.py). Pure, fast."""

import json

from megatron_recover.megatron.app.report import RecoverLog
from megatron_recover.recovery import StepReport


def report(iteration):
    return StepReport(iteration=iteration, loss=1.0, contributions=1, B=1, live_replicas=1,
                      epoch=0, ledger_checksum=0, invariant_ok=True, ledger_problems=[],
                      grad_norm=None, loss_scale=1.0, skipped=False, iteration_ms=1.0,
                      extension_rounds=0, buckets=1)


def iterations(path):
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines()]


def test_a_new_writer_writes_what_the_log_lacks(tmp_path):
    path = tmp_path / "log.jsonl"
    first = RecoverLog(path, last_written=0)
    first.write_missing([(report(1), {})])
    first.write_missing([(report(2), {"lr": 0.1})])
    with path.open("a") as f:
        f.write('{"iteration": 3, "lo')  # the writer died halfway through a line
    # Two writers died after their commits: the next one holds records 2-4 and writes 3 and 4.
    RecoverLog(path).write_missing([(report(t), {}) for t in (2, 3, 4)])
    assert iterations(path) == [1, 2, 3, 4]
    assert json.loads(path.read_text().splitlines()[1])["lr"] == 0.1


def test_a_resumed_run_appends_its_redone_iterations(tmp_path):
    path = tmp_path / "log.jsonl"
    RecoverLog(path, last_written=0).write_missing([(report(t), {}) for t in (1, 2, 3)])
    # Relaunched from a checkpoint of iteration 2: iteration 3 is trained again and logged.
    RecoverLog(path, last_written=2).write_missing([(report(3), {})])
    assert iterations(path) == [1, 2, 3, 3]
