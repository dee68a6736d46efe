"""The interleaved pipeline schedule (virtual pipeline stages) under --recover: PP=2 with 2 model
chunks per rank, 4 replicas of 2 ranks, static exact policy.

Run: `make test`. CPU only; 8 (2) oversubscribed ranks per run, each under a hard timeout.

- Iteration 2: replica 3 dies inside a bucket reduction. Its 2 ids go to the 3 survivors: an
  extension pass of 1 microbatch each on two of them, which megatron-core's interleaved schedule
  refuses (fewer microbatches than pipeline stages), so the pass runs with one padding
  microbatch (interleaving.py). Inside that extension pass replica 1 dies (its second rank, at
  `during-extension`), and the last two replicas run a second extension pass of 2 microbatches.
  Every loss and final parameter equals the failure-free interleaved run within the exact
  tolerance, the ledger holds every iteration (a padding microbatch that contributed would
  count an id twice: tests/test_ledger_mutations.py), both ranks of each dead replica leave and
  the survivors at each position are bitwise equal.
- A failure-free --recover run (one replica, no dropout) saves a torch_dist checkpoint at
  iteration 2 (each rank's chunks under "model0" and "model1", as Megatron-LM keys them); a
  stock (no --recover) interleaved run loads it and trains iterations 3 and 4 to bitwise the
  same parameters. With several replicas the two modes agree within the exact tolerance, not
  bitwise: Megatron's sampler gives data-parallel rank r the microbatches r, r + DP, ..., the
  --recover layout gives a replica a contiguous range, and the partial sums round differently.
"""

import pytest
import torch

from megatron_recover.launch import LaunchConfig, launch
from megatron_recover.testing.compare import EXACT_RTOL, loss_rdiff, param_rdiff
from tests.mpirun_harness import ENTRY
from tests.training_harness import (
    STABLE_LR,
    TrainingRun,
    assert_exact,
    assert_ledger_held,
    megatron_lm_lines,
    printed_values,
    run_training,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
TIMEOUT_S = 240
RANKS = 8
B = 8
JOB = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
       "--eval-iters", "0", "--seq-length", "32", "--max-position-embeddings", "32",
       "--micro-batch-size", "1", "--global-batch-size", str(B), "--train-iters", "4",
       *STABLE_LR, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--log-interval", "1", "--ddp-bucket-size", "2000",
       "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
SCHEDULE = """entries:
  - {iteration: 2, replica: 3, local_rank: 0, location: during-reduce}
  - {iteration: 2, replica: 1, local_rank: 1, location: during-extension}
"""
# Megatron's rank order with PP=2 over 8 ranks: replica r is world ranks r (stage 0) and r + 4.
VICTIMS = {3: 3, 1: 5}  # replica -> the rank the schedule kills
PEERS = {3: 7, 1: 1}  # replica -> its other rank, which leaves through the replica gate


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> TrainingRun:
    return run_training(tmp_path_factory.mktemp("interleaved") / "reference", RANKS, JOB,
                        timeout_s=TIMEOUT_S)


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_failures_in_a_reduction_and_a_padded_extension_pass_stay_exact(tmp_path, reference):
    run = run_training(tmp_path / "failures", RANKS, JOB, SCHEDULE, TIMEOUT_S)
    fired = sorted((m["rank"], m["iteration"], m["location"]) for m in run.markers)
    assert fired == [(3, 2, "during-reduce"), (5, 2, "during-extension")]
    failures = [e for e in run.records[1]["events"] if e["event"] == "failure"]
    # The first extension pass gave each extending replica one microbatch (then padded).
    assert [(e["replicas"], e["g_ext"]) for e in failures] == [([3], 1), ([1], 2)]
    assert run.records[1]["extension_rounds"] == 2
    assert [r["iteration"] for r in run.records] == [1, 2, 3, 4]
    assert_ledger_held(run.records, B)
    statuses = run.result.statuses
    for replica, peer in PEERS.items():
        assert statuses[peer]["state"] == "left", (replica, statuses[peer])
    assert run.completed() == [0, 2, 4, 6]
    for stage in (0, 1):  # the survivors of each position hold the same bytes
        digests = {statuses[r]["param_digest"] for r in run.completed() if r // 4 == stage}
        assert len(digests) == 1, (stage, digests)
    assert_exact(run, reference, "interleaved, failures in a reduction and an extension pass")


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_a_stock_run_resumed_from_its_checkpoint_trains_as_the_failure_free_run(tmp_path):
    # One replica; no dropout: a stock run draws its masks in sequence, --recover per microbatch.
    job = [*JOB, "--hidden-dropout", "0", "--attention-dropout", "0"]
    ckpt = tmp_path / "ckpt"
    resilient = run_training(tmp_path / "recover", 2, [*job, "--save", str(ckpt),
                                                       "--save-interval", "2"],
                             timeout_s=TIMEOUT_S)
    assert (ckpt / "iter_0000002" / "metadata.json").is_file()  # a torch_dist checkpoint
    stock = launch(LaunchConfig(2, [*ENTRY, *job, "--load", str(ckpt), "--ckpt-step", "2"],
                                tmp_path / "stock", timeout_s=TIMEOUT_S))
    assert stock.succeeded, stock.output[-4000:]
    assert "successfully loaded checkpoint" in stock.output
    losses = printed_values(stock.output, "lm loss")
    expected = list(megatron_lm_lines({r["iteration"]: r["loss"]  # iterations 3 and 4
                                       for r in resilient.records[2:]}).values())
    assert len(losses) == len(expected) == 2
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    assert worst <= 1e-6, (losses, expected)  # the printed loss has 7 significant digits
    for rank in range(2):  # bitwise, at both pipeline stages
        assert (stock.statuses[rank]["param_digest"]
                == resilient.result.statuses[rank]["param_digest"]), rank
        assert param_rdiff(torch.load(tmp_path / "stock" / f"rank-{rank}.params.pt"),
                           resilient.params(rank)) == 0.0


# 6 replicas, B = 12: after replica 5 dies in iteration 1, replica 4 shadows replica 0 (with
# G_init >= PP no spare exists among 4 replicas: `megatron-recover plan`). Iteration 2: replica
# 0 dies inside a reduction and replica 4 is promoted (a blocking restore: every bucket of both
# chunks rewound and reduced again); inside that restore replica 1 dies, and its 3 ids go to
# the 3 survivors as an extension pass of 1 microbatch each (padded).
BLOCKING_SCHEDULE = """entries:
  - {iteration: 1, replica: 5, local_rank: 0, location: during-reduce}
  - {iteration: 2, replica: 0, local_rank: 0, location: during-reduce}
  - {iteration: 2, replica: 1, local_rank: 1, location: during-restore}
"""


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_a_failure_inside_a_blocking_restore_stays_exact(tmp_path):
    job = [*JOB, "--global-batch-size", "12"]
    reference = run_training(tmp_path / "reference", 12, job, timeout_s=TIMEOUT_S)
    run = run_training(tmp_path / "failures", 12, job, BLOCKING_SCHEDULE, TIMEOUT_S)
    fired = sorted((m["rank"], m["iteration"], m["location"]) for m in run.markers)
    assert fired == [(0, 2, "during-reduce"), (5, 1, "during-reduce"), (7, 2, "during-restore")]
    failures = [e for e in run.records[1]["events"] if e["event"] == "failure"]
    assert failures[0]["replicas"] == [0] and failures[0]["restore"] == "blocking"
    assert failures[0]["promotions"] == [[0, 4]]
    assert failures[1]["replicas"] == [1] and failures[1]["g_ext"] == 1
    assert_ledger_held(run.records, 12)
    assert run.completed() == [2, 3, 4, 8, 9, 10]
    assert_exact(run, reference, "interleaved, a failure inside a blocking restore")


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_a_standby_joins_with_the_distributed_optimizer(tmp_path):
    """3 replicas and a standby replica, each of PP=2 ranks with 2 model chunks, the
    distributed optimizer (one instance per replica): replica 2 dies in iteration 2 and the
    standby takes its id after it, its state (both chunks, and each chunk's optimizer shard
    under names of its own chunk) sent by a live replica's ranks."""
    job = [*JOB, "--global-batch-size", "6", "--use-distributed-optimizer", "--train-iters", "5",
           "--recover-standby-replicas", "1"]
    schedule = "entries:\n  - {iteration: 2, replica: 2, local_rank: 0, location: during-reduce}\n"
    reference = run_training(tmp_path / "reference", 8, job, timeout_s=TIMEOUT_S)
    run = run_training(tmp_path / "failures", 8, job, schedule, TIMEOUT_S)
    joins = [(r["iteration"], e["replicas"], e["ranks"]) for r in run.records
             for e in r["events"] if e["event"] == "join"]
    assert joins == [(3, [2], [6])], joins  # as the log writer's position (stage 0) saw it
    for rank in (6, 7):  # the standby's two stages hold their donors' state bitwise
        joined = run.result.statuses[rank]["joined"]
        assert joined["digests"] == joined["donor_digests"], (rank, joined)
    assert_ledger_held(run.records, 6)
    assert run.completed() == [0, 1, 3, 4, 6, 7]
    loss = loss_rdiff(run.records, reference.records)
    # Every survivor against the reference's rank 0 or 3, of its stage (the standby idled
    # there; its ranks 6 and 7 are stages 0 and 1).
    stage = {rank: rank // 3 if rank < 6 else rank - 6 for rank in run.completed()}
    params = max(param_rdiff(run.params(rank), reference.params(3 * stage[rank]))
                 for rank in run.completed())
    print(f"interleaved, a standby joins with the distributed optimizer: loss {loss:.2e}, "
          f"final parameters {params:.2e}")
    assert loss <= EXACT_RTOL and params <= EXACT_RTOL, (loss, params)
