"""End-to-end: pretrain_gpt_recover.py under mpirun --with-ft ulfm loses replicas and keeps the
failure-free loss curve (exact mode); negative controls show the test can fail.

Run: `make test`. CPU only (megatron-core under the CPU emulation), 5 oversubscribed ranks, each
run under a hard timeout. Dropout is on; the model has at least 3 gradient buckets, so failures
land in partially reduced iterations.
"""

import pytest

from tests.training_harness import (
    EXACT_LOSS_RTOL,
    STABLE_LR,
    assert_exact,
    assert_ledger_held,
    loss_rdiff,
    run_training,
)

pytestmark = pytest.mark.mpi
TIMEOUT_S = 300
REPLICAS = 5
ITERATIONS = 10
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--eval-iters", "0",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", "20", "--train-iters", str(ITERATIONS), *STABLE_LR,
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--log-interval", "1",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
# Iteration 3: replica 1 dies inside a bucket's all-reduce (a policy boundary), and replica 2
# inside the extension pass that follows; iteration 6: replica 4 during its backward.
SCHEDULE = """entries:
  - {iteration: 3, replica: 1, local_rank: 0, location: during-reduce}
  - {iteration: 3, replica: 2, local_rank: 0, location: during-extension}
  - {iteration: 6, replica: 4, local_rank: 0, location: backward}
"""
SURVIVORS = [0, 3]


def train(tmp_path, name, extra, schedule=None):
    return run_training(tmp_path / name, REPLICAS, [*MODEL, *extra], schedule, TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = train(tmp_path_factory.mktemp("reference"), "reference", [])
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    return run


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_exact_mode_keeps_the_loss_curve(tmp_path, reference):
    run = train(tmp_path, "exact", [], SCHEDULE)
    result, records = run.result, run.records
    assert sorted((m["rank"], m["iteration"], m["location"]) for m in run.markers) == [
        (1, 3, "during-reduce"), (2, 3, "during-extension"), (4, 6, "backward")]
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    assert all(r["buckets"] >= 3 for r in records)
    assert_ledger_held(records, 20)
    assert [r["live_replicas"] for r in records] == [5, 5, 3, 3, 3, 2, 2, 2, 2, 2]
    assert records[2]["extension_rounds"] == 2  # the extension pass itself lost a replica
    assert_exact(run, reference, "exact mode")
    digests = {rank: result.statuses[rank]["param_digest"] for rank in SURVIVORS}
    assert len(set(digests.values())) == 1, digests
    assert all(result.statuses[r]["state"] == "running" for r in (1, 2, 4))  # killed


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("control", ["no-restore", "adaptive"])
def test_negative_controls_deviate(tmp_path, reference, control):
    """Same schedule without gradient restoration, or with drop-and-go: the curve must move."""
    extra = ["--recover-no-restore"] if control == "no-restore" else ["--recover-policy",
                                                                       "adaptive"]
    run = train(tmp_path, control, extra, SCHEDULE)
    diff = loss_rdiff(run.records, reference.records)
    print(f"{control}: max relative loss difference {diff:.2e}")
    assert diff >= 100 * EXACT_LOSS_RTOL, diff
    if control == "no-restore":
        # The ledger sees it too: buckets reduced again while holding a cross-replica sum.
        assert not all(r["invariant_ok"] for r in run.records)
