"""Replicas of several ranks (TP=2 x DP=2, PP=2 x DP=2): a replica leaves as a unit, the other
keeps the failure-free loss curve.

Run: `make test`. CPU only; 4 oversubscribed ranks per run, each under a hard timeout. The
victim is local rank 0 inside a bucket reduce, or local rank 1 inside the commit consensus or at
the optimizer step; its replica peer must leave on its own (the replica gate), and the ranks of
the surviving replica must act on one verdict (otherwise their TP/PP collectives would diverge).
"""

import json

import pytest

from megatron_recover.faults import read_markers
from megatron_recover.launch import LaunchConfig, launch
from tests.mpirun_harness import ENTRY

pytestmark = pytest.mark.mpi
TIMEOUT_S = 240
TOLERANCE = 1e-5
ITERATIONS = 5
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
       "--global-batch-size", "8", "--train-iters", str(ITERATIONS), "--lr", "1e-2",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--log-interval", "1", "--recover"]
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"],
           "pp2": ["--pipeline-model-parallel-size", "2"]}
# Megatron's rank order: with TP=2 replica 1 is world ranks 2, 3; with PP=2 it is ranks 1, 3.
REPLICA1 = {"tp2": {0: 2, 1: 3}, "pp2": {0: 1, 1: 3}}
SCENARIOS = [(0, "during-reduce"), (1, "during-consensus"), (1, "optimizer-step")]


def train(tmp_path, layout, schedule=None):
    log = tmp_path / "log.jsonl"
    extra = []
    if schedule is not None:
        (tmp_path / "schedule.yaml").write_text(schedule)
        extra = ["--recover-failure-schedule", str(tmp_path / "schedule.yaml")]
    result = launch(LaunchConfig(4, [*ENTRY, *JOB, *LAYOUTS[layout], "--recover-log", str(log),
                                     *extra], tmp_path / "status", TIMEOUT_S))
    assert not result.timed_out, result.output[-4000:]
    assert result.succeeded, result.output[-4000:]
    return result, [json.loads(line) for line in log.read_text().splitlines()], log


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {layout: train(tmp_path_factory.mktemp(layout), layout)[1] for layout in LAYOUTS}


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("local_rank, location", SCENARIOS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replica_leaves_as_a_unit(tmp_path, references, layout, local_rank, location):
    schedule = (f"entries:\n  - {{iteration: 3, replica: 1, local_rank: {local_rank}, "
                f"location: {location}}}\n")
    result, records, log = train(tmp_path, layout, schedule)
    victim = REPLICA1[layout][local_rank]
    peer = REPLICA1[layout][1 - local_rank]
    markers = read_markers(log.with_suffix(".markers.jsonl"))
    assert [(m["rank"], m["location"]) for m in markers] == [(victim, location)]
    # The peer was not scheduled to die: it left through the replica gate.
    assert result.statuses[peer]["state"] == "left", result.statuses[peer]
    survivors = sorted(set(range(4)) - {victim, peer})
    assert all(result.statuses[r]["state"] == "completed" for r in survivors)
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    assert all(r["contributions"] == r["B"] == 8 and r["invariant_ok"] for r in records)
    assert records[-1]["live_replicas"] == 1
    reference = references[layout]
    diffs = [abs(r["loss"] - ref["loss"]) / ref["loss"] for r, ref in zip(records, reference)]
    print(f"{layout} {location} (local rank {local_rank}): max relative loss diff "
          f"{max(diffs):.2e}")
    assert max(diffs) <= TOLERANCE, diffs
