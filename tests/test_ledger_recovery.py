"""End-to-end: the two recovery paths the gradient ledger exposed, each exact after the fix.

Run: `make test` (or `.venv/bin/python -m pytest tests/test_ledger_recovery.py`). CPU only,
oversubscribed ranks under a hard timeout, about a minute and a half.

1. Extension gradients of an unpromoted spare, then a blocking restore in the same iteration.
   7 replicas, G = 1 (B = 7). Iteration 1 loses replica 0, so iteration 2 runs majors 1-3 (two
   ids each), minor 4 (id 6), major-spare 5 and minor-spare 6 (`megatron-recover plan --w-init 7
   --g-init 1 --iterations 2 --fail 1:0 --fail 2:2 --fail 2:5@extension`). Iteration 2 loses
   major 2, whose spare shadows another slot: a boundary; the minor-spare 6 (first pass not
   contributing) gets extension id 3. Replica 5, holding nothing, dies inside that extension
   pass: a blocking restore. Before the fix the restore zeroed replica 6's bucket at reduce time,
   dropping id 3's gradient while the policy still counted it.
2. Distributed-optimizer instances with fewer extension ids than shards: 3 instances x 2 shards,
   B = 6; instance 2 dies, each survivor gets one extension id, so one shard per instance has
   none. Before the fix that shard ran megatron's schedule with zero microbatches, raised
   StopIteration and took its instance down; the run died.
"""

import pytest

from tests.training_harness import (
    STABLE_LR,
    assert_exact,
    assert_ledger_held,
    run_training,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
TIMEOUT_S = 300
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--eval-iters", "0",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "128", "--ddp-bucket-size", "2000", "--log-interval", "1",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1", *STABLE_LR]

SPARE_JOB = [*MODEL, "--global-batch-size", "7"]
SPARE_SCHEDULE = """entries:
  - {iteration: 1, replica: 0, local_rank: 0, location: during-reduce}
  - {iteration: 2, replica: 2, local_rank: 0, location: during-reduce}
  - {iteration: 2, replica: 5, local_rank: 0, location: during-extension}
"""

HSDP_JOB = [*MODEL, "--global-batch-size", "6", "--use-distributed-optimizer",
            "--num-distributed-optimizer-instances", "3"]
HSDP_SCHEDULE = """entries:
  - {iteration: 2, replica: 2, local_rank: 0, location: during-reduce}
"""


def failures(records):
    return [e for r in records for e in r["events"] if e["event"] == "failure"]


@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_spare_extension_ids_survive_a_blocking_restore(tmp_path):
    reference = run_training(tmp_path / "reference", 7, SPARE_JOB, timeout_s=TIMEOUT_S)
    run = run_training(tmp_path / "failures", 7, SPARE_JOB, SPARE_SCHEDULE, timeout_s=TIMEOUT_S)
    fired = sorted((m["rank"], m["iteration"], m["location"]) for m in run.markers)
    assert fired == [(0, 1, "during-reduce"), (2, 2, "during-reduce"),
                     (5, 2, "during-extension")]
    first, boundary, blocking = failures(run.records)
    assert boundary["replicas"] == [2] and boundary["g_ext"] == 1
    assert blocking["replicas"] == [5] and blocking["restore"] == "blocking"
    assert_ledger_held(run.records, 7)
    assert run.completed() == [1, 3, 4, 6]
    assert_exact(run, reference, "spare's extension ids, then a blocking restore")


@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_hsdp_extension_with_fewer_ids_than_shards(tmp_path):
    reference = run_training(tmp_path / "reference", 6, HSDP_JOB, timeout_s=TIMEOUT_S)
    run = run_training(tmp_path / "failures", 6, HSDP_JOB, HSDP_SCHEDULE, timeout_s=TIMEOUT_S)
    assert [(m["rank"], m["location"]) for m in run.markers] == [(4, "during-reduce")]
    (event,) = failures(run.records)
    assert event["replicas"] == [2] and event["g_ext"] == 1  # one id for two shards
    assert_ledger_held(run.records, 6)
    assert run.completed() == [0, 1, 2, 3]
    assert_exact(run, reference, "HSDP 3x2, one extension id per instance")


WRITER_JOB = [*MODEL, "--global-batch-size", "8"]
WRITER_SCHEDULE = """entries:
  - {iteration: 2, replica: 0, local_rank: 0, location: optimizer-step}
  - {iteration: 3, replica: 1, local_rank: 0, location: optimizer-step}
"""


@pytest.mark.long  # make test kills the writer in tests/test_evaluation_logging.py
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_one_record_per_iteration_when_the_writer_dies_after_a_commit(tmp_path):
    """Rank 0 writes the log; it dies at the optimizer step, after iteration 2 committed and
    before its record was out. Rank 1, the writer from iteration 3 on, dies the same way after
    iteration 3 committed. Rank 2 writes the records of iterations 2 and 3, once each."""
    reference = run_training(tmp_path / "reference", 4, WRITER_JOB, timeout_s=TIMEOUT_S)
    run = run_training(tmp_path / "failures", 4, WRITER_JOB, WRITER_SCHEDULE, timeout_s=TIMEOUT_S)
    assert [(m["rank"], m["location"]) for m in run.markers] == [(0, "optimizer-step"),
                                                                 (1, "optimizer-step")]
    assert [r["iteration"] for r in run.records] == [1, 2, 3, 4]
    assert_ledger_held(run.records, 8)
    assert_exact(run, reference, "two writers lost after their commits")
