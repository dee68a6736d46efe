"""Replicas of several ranks (TP=2 x DP=2, PP=2 x DP=2): a replica leaves as a unit, the other
keeps the failure-free loss curve.

Run: `make test`. CPU only; 4 oversubscribed ranks per run, each under a hard timeout. The
victim is local rank 0 inside a bucket reduce, or local rank 1 inside the commit consensus or at
the optimizer step; its replica peer must leave on its own (the replica gate), and the ranks of
the surviving replica must act on one verdict (otherwise their TP/PP collectives would diverge).
"""

import pytest

from tests.training_harness import STABLE_LR, assert_exact, assert_ledger_held, run_training

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
TIMEOUT_S = 240
ITERATIONS = 5
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--eval-iters", "0",
       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
       "--global-batch-size", "8", "--train-iters", str(ITERATIONS), *STABLE_LR,
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--log-interval", "1"]
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"],
           "pp2": ["--pipeline-model-parallel-size", "2"]}
# Megatron's rank order: with TP=2 replica 1 is world ranks 2, 3; with PP=2 it is ranks 1, 3.
REPLICA1 = {"tp2": {0: 2, 1: 3}, "pp2": {0: 1, 1: 3}}
# (0, "backward") on PP=2 is the first stage, which computes no loss: its point follows its
# first forward there.
SCENARIOS = [(0, "during-reduce"), (1, "during-consensus"), (1, "optimizer-step"),
             (0, "backward")]
# `make test` runs one TP scenario (a PP=2 replica leaving as a unit is in
# tests/test_interleaved.py); `make test-long` the other seven.
IN_MAKE_TEST = {("tp2", 0, "during-reduce")}
CASES = [pytest.param(layout, local_rank, location, id=f"{layout}-{local_rank}-{location}",
                      marks=[] if (layout, local_rank, location) in IN_MAKE_TEST
                      else [pytest.mark.long])
         for layout in LAYOUTS for local_rank, location in SCENARIOS]


def train(tmp_path, layout, schedule=None):
    return run_training(tmp_path / "run", 4, [*JOB, *LAYOUTS[layout]], schedule, TIMEOUT_S)


class _References(dict):
    """Each layout's failure-free run, made the first time a test asks for it."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, layout):
        self[layout] = train(self.tmp_path_factory.mktemp(layout), layout)
        return self[layout]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return _References(tmp_path_factory)


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("layout, local_rank, location", CASES)
def test_replica_leaves_as_a_unit(tmp_path, references, layout, local_rank, location):
    schedule = (f"entries:\n  - {{iteration: 3, replica: 1, local_rank: {local_rank}, "
                f"location: {location}}}\n")
    run = train(tmp_path, layout, schedule)
    result, records = run.result, run.records
    victim = REPLICA1[layout][local_rank]
    peer = REPLICA1[layout][1 - local_rank]
    assert [(m["rank"], m["location"]) for m in run.markers] == [(victim, location)]
    # The peer was not scheduled to die: it left through the replica gate.
    assert result.statuses[peer]["state"] == "left", result.statuses[peer]
    survivors = sorted(set(range(4)) - {victim, peer})
    assert all(result.statuses[r]["state"] == "completed" for r in survivors)
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    assert_ledger_held(records, 8)
    assert records[-1]["live_replicas"] == 1
    assert_exact(run, references[layout], f"{layout} {location} (local rank {local_rank})")


@pytest.mark.long  # `make test` extends PP=2 passes without overlap: tests/test_interleaved.py
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_pp2_extension_pass_without_overlap_counts_the_tied_embedding_once(tmp_path):
    """Without --overlap-grad-reduce too, megatron syncs the tied embedding between the first
    and last stage after backward. A failure inside a reduction makes the survivor extend the
    iteration; the non-blocking restore empties that bucket for the pass and adds its snapshot
    after it, so the sync never counts the snapshot's synced sum twice."""
    job = [a for a in JOB if a != "--overlap-grad-reduce"] + LAYOUTS["pp2"]
    reference = run_training(tmp_path / "reference", 4, job, None, TIMEOUT_S)
    schedule = "entries:\n  - {iteration: 3, replica: 1, local_rank: 0, location: during-reduce}\n"
    run = run_training(tmp_path / "run", 4, job, schedule, TIMEOUT_S)
    assert [(m["rank"], m["location"]) for m in run.markers] == [(1, "during-reduce")]
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    assert run.records[2]["extension_rounds"] >= 1  # the failure was a policy boundary
    assert_ledger_held(run.records, 8)
    assert_exact(run, reference, "pp2 without overlap, extension pass")
