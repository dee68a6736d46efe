"""End-to-end: pretrain_gpt_recover.py under mpirun --with-ft ulfm loses replicas and keeps the
failure-free loss curve (exact mode); negative controls show the test can fail. Errors raised
into Python are classified (docs/failures.md): a device fault is survived in-step like a lost
peer, a program error ends the job, unless --recover-program-errors survive.

Run: `make test`. CPU only (megatron-core under the CPU emulation), 5 oversubscribed ranks, each
run under a hard timeout. Dropout is on; the model has at least 3 gradient buckets, so failures
land in partially reduced iterations.
"""

import json
import math
import os
import sys
from pathlib import Path

import pytest

from megatron_recover.errors import PROGRAM_ERROR_EXIT
from megatron_recover.launch import program_error, read_statuses, run_bounded
from tests.mpirun_harness import ENTRY
from tests.training_harness import (
    EXACT_LOSS_RTOL,
    STABLE_LR,
    assert_exact,
    assert_ledger_held,
    loss_rdiff,
    param_rdiff,
    printed_values,
    run_training,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
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
@pytest.mark.parametrize("plane", ["torch", "mpi"])
def test_exact_mode_keeps_the_loss_curve(tmp_path, reference, plane):
    """On either data plane (docs/data-planes.md), against the same failure-free reference (on
    the default plane, torch)."""
    run = train(tmp_path, "exact", ["--recover-data-plane", plane], SCHEDULE)
    result, records = run.result, run.records
    announced = "cross-replica data plane: torch (gloo" in result.output
    assert announced == (plane == "torch"), result.output[-3000:]
    assert "cross-replica data plane: torch (gloo" in reference.result.output
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


# make test's budget: both run in make test-long; tests/unit/test_mutations.py and the lockstep
# negative control (Setup.restore=False) show in process that the ledger catches a missing
# restore.
@pytest.mark.long
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


# docs/failures.md: a device fault is survived in-step, like a lost peer; a program error ends
# the job (the same microbatch would fail on every replica that reran it).
DEVICE_AND_PEER = """entries:
  - {iteration: 4, replica: 2, local_rank: 0, location: backward, action: device-error}
  - {iteration: 7, replica: 4, local_rank: 0, location: during-reduce}
"""
# docs/failures.md: a replica whose gradient turns NaN (a faulty device's backward) fails
# Megatron's check before its buckets leave it, and leaves as a device fault does.
NAN_GRADIENT = """entries:
  - {iteration: 4, replica: 2, local_rank: 0, location: backward, action: nan}
"""
PROGRAM_ERROR = """entries:
  - {iteration: 4, replica: 2, local_rank: 0, location: backward, action: raise}
"""


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_device_error_and_a_lost_peer_are_survived_in_step(tmp_path, reference):
    run = train(tmp_path, "device", [], DEVICE_AND_PEER)
    records, statuses = run.records, run.result.statuses
    assert sorted((m["rank"], m["iteration"], m["location"], m["action"]) for m in run.markers
                  ) == [(2, 4, "backward", "device-error"), (4, 7, "during-reduce", "kill")]
    assert statuses[2]["state"] == "left" and statuses[2]["kind"] == "device", statuses[2]
    assert "DeviceFault" in statuses[2]["error"]
    assert (statuses[2]["iteration"], statuses[2]["microbatch_id"]) == (4, 8)
    failed = [(r["iteration"], e["replicas"]) for r in records for e in r["events"]
              if e["event"] == "failure"]
    assert failed == [(4, [2]), (7, [4])]
    assert_ledger_held(records, 20)
    assert_exact(run, reference, "device error and lost peer")


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """Replica 2's NaN gradient of iteration 4, taken out by Megatron's check (shared: the
    flipped-bit run must equal it bitwise)."""
    return train(tmp_path_factory.mktemp("nan"), "nan", [], NAN_GRADIENT)


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_nan_gradient_takes_its_replica_out_before_it_reaches_the_others(nan_run, reference):
    run = nan_run
    records, statuses = run.records, run.result.statuses
    assert [(m["rank"], m["iteration"], m["action"]) for m in run.markers] == [(2, 4, "nan")]
    assert statuses[2]["state"] == "left" and statuses[2]["kind"] == "device", statuses[2]
    assert ("NonFiniteResult: found NaN in local grad norm for bucket #0 before the "
            "cross-replica reduction") in statuses[2]["error"], statuses[2]["error"][-2000:]
    failed = [(r["iteration"], e["replicas"]) for r in records for e in r["events"]
              if e["event"] == "failure"]
    assert failed == [(4, [2])]
    assert_ledger_held(records, 20)
    assert_exact(run, reference, "NaN gradient")


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_transient_nan_rerun_and_kept_is_the_failure_free_run(tmp_path, reference):
    """docs/failures.md: with --recover-nonfinite-rerun keep, replica 2 holds its NaN gradient
    out, reruns its microbatches (finite: the schedule's NaN fires once) while replica 3 runs
    them too, and contributes the rerun: no replica is lost, and the run is the failure-free
    one bit for bit."""
    run = train(tmp_path, "nan-kept", ["--recover-nonfinite-rerun", "keep"], NAN_GRADIENT)
    assert [(m["rank"], m["iteration"], m["action"]) for m in run.markers] == [(2, 4, "nan")]
    assert run.completed() == list(range(REPLICAS))
    events = [(r["iteration"], e["event"]) for r in run.records for e in r["events"]]
    assert events == [(4, "nonfinite"), (4, "rerun")], events
    rerun = next(e for e in run.records[3]["events"] if e["event"] == "rerun")
    assert rerun["outcomes"] == {"2": "transient"} and rerun["kept"] == [2], rerun
    assert "non-finite gradient classified replica 2: transient" in run.result.output
    assert printed_values(run.result.output, "non-finite reruns") == [0, 0, 0, 1, 0, 0, 0, 0,
                                                                        0, 0]
    assert set(printed_values(run.result.output, "evicted for non-finite")) == {0}
    assert_ledger_held(run.records, 20)
    assert [r["loss"] for r in run.records] == [r["loss"] for r in reference.records]
    for rank in range(REPLICAS):
        assert param_rdiff(run.params(rank), reference.params(rank)) == 0.0, rank


# Replica 2 takes 0.3 s longer per microbatch from iteration 3 on (a few times its compute here);
# replica 4 dies in iteration 6's backward.
STRAGGLER = """entries:
  - {iteration: 3, replica: 2, local_rank: 0, location: pre-forward, action: slow, seconds: 0.3}
  - {iteration: 6, replica: 4, local_rank: 0, location: backward}
"""


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_straggler_gets_fewer_microbatches_and_a_failure_stays_exact(tmp_path, reference):
    """docs/stragglers.md: replica 2, slowed from iteration 3, is slower than twice the others'
    median for the window of 2 iterations, so from iteration 5 it gets fewer microbatches and
    the others more; replica 4 dies in iteration 6 and the balanced layout absorbs it. Every
    iteration commits B with the ledger held, and losses and parameters are the failure-free
    run's within the exact tolerance (the ids moved between replicas, so sums reassociate)."""
    run = train(tmp_path, "straggler", ["--recover-straggler-threshold", "1.0",
                                        "--recover-straggler-window", "2"], STRAGGLER)
    assert [(m["rank"], m["iteration"], m["action"]) for m in run.markers] == [
        (2, 3, "slow"), (4, 6, "kill")], run.markers
    assert run.completed() == [0, 1, 2, 3]
    quotas = [r["quotas"] for r in run.records]
    assert [q["2"] for q in quotas] == [4] * 4 + [q["2"] for q in quotas[4:]]
    assert all(q["2"] < 4 for q in quotas[4:]), quotas
    assert all(sum(q.values()) == 20 for q in quotas) and "4" not in quotas[6], quotas
    assert [r["slow"] for r in run.records[3:]] == [[2]] * 7, [r["slow"] for r in run.records]
    speeds = run.records[4]["speeds"]
    assert speeds["2"] > 2 * max(t for r, t in speeds.items() if r != "2"), speeds
    printed = [line.split("microbatches per replica: ")[1].split(" |")[0]
               for line in run.result.output.splitlines() if "microbatches per replica:" in line]
    assert printed == [",".join(f"{r}:{n}" for r, n in sorted(q.items())) for q in quotas], printed
    assert printed_values(run.result.output, "slow replicas") == [0, 0, 0] + [1] * 7
    assert_ledger_held(run.records, 20)
    assert_exact(run, reference, "straggler balanced, then a failure")


# make test's budget: the negative controls of the NaN check and of verification run in make
# test-long (tests/unit/test_nonfinite_rerun.py and test_verification.py have in-process ones).
@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_without_the_check_a_nan_gradient_poisons_every_replica(tmp_path):
    """The negative control: --no-check-for-nan-in-loss-and-grad lets the NaN into the sum."""
    run = train(tmp_path, "nan-unchecked", ["--no-check-for-nan-in-loss-and-grad",
                                            "--exit-interval", "5"], NAN_GRADIENT)
    assert [(m["rank"], m["iteration"], m["action"]) for m in run.markers] == [(2, 4, "nan")]
    assert run.completed() == list(range(REPLICAS))
    losses = [r["loss"] for r in run.records]
    assert all(math.isfinite(loss) for loss in losses[:4]) and math.isnan(losses[4]), losses


# docs/verification.md: one exponent bit of one gradient element flipped on replica 2 before
# its buckets leave it: finite, so Megatron's NaN check passes it; sampled verification at rate 1
# catches it (replica 3 checks replica 2, replica 4 arbitrates) and evicts replica 2.
BITFLIP = """entries:
  - {iteration: 4, replica: 2, local_rank: 0, location: before-reduce, action: bitflip}
"""


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_flipped_bit_is_caught_by_verification_and_its_replica_evicted(tmp_path, reference,
                                                                         nan_run):
    run = train(tmp_path, "bitflip", ["--recover-sdc-check-rate", "1"], BITFLIP)
    records, statuses = run.records, run.result.statuses
    [marker] = run.markers
    assert (marker["rank"], marker["iteration"], marker["action"]) == (2, 4, "bitflip")
    assert marker["after"] != marker["before"] and math.isfinite(marker["after"]), marker
    assert statuses[2]["state"] == "left" and statuses[2]["kind"] == "device", statuses[2]
    assert "SilentCorruption" in statuses[2]["error"], statuses[2]["error"][-2000:]
    events = [(r["iteration"], e["event"]) for r in records for e in r["events"]]
    assert events[:3] == [(4, "mismatch"), (4, "corruption"), (4, "failure")], events
    mismatch, corruption = records[3]["events"][:2]
    assert (mismatch["owners"], mismatch["checkers"], mismatch["arbiters"]) == ([2], [3], [4])
    assert corruption["evicted"] == [2]
    # Every microbatch of the iterations before was computed twice, and agreed bitwise; the
    # check passes left the trajectory as it is without them, bit for bit.
    assert [r["verified"] for r in records[:3]] == [20, 20, 20]
    assert [r["loss"] for r in records[:3]] == [r["loss"] for r in reference.records[:3]]
    assert_ledger_held(records, 20)
    assert_exact(run, reference, "bit flip, verified")
    # Replica 2 evicted before the commit is replica 2 failed at the same place: the NaN run,
    # whose check took it out before its buckets left it. Bit for bit: nothing of the flipped
    # gradient reached the survivors.
    assert [r["loss"] for r in records] == [r["loss"] for r in nan_run.records]
    assert run.completed() == nan_run.completed() == [0, 1, 3, 4]
    for rank in run.completed():
        assert param_rdiff(run.params(rank), nan_run.params(rank)) == 0.0, rank
    assert "evicted for corruption: 1 |" in run.result.output


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_without_verification_a_flipped_bit_departs_from_the_trajectory(tmp_path, reference):
    """The negative control: the same flip at rate 0 passes every check and is committed."""
    run = train(tmp_path, "bitflip-unverified", [], BITFLIP)
    [marker] = run.markers
    assert (marker["rank"], marker["iteration"], marker["action"]) == (2, 4, "bitflip")
    assert run.completed() == list(range(REPLICAS))
    records = run.records
    # The same run as the reference up to the flip, then another: the flipped element went into
    # iteration 4's step on every replica (with Adam, one element's update moves little).
    assert [r["loss"] for r in records[:4]] == [r["loss"] for r in reference.records[:4]]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[4]["loss"] != reference.records[4]["loss"]
    assert all(param_rdiff(run.params(rank), reference.params(rank)) > 0
               for rank in range(REPLICAS))


# A sample whose loss is NaN wherever it runs: the forward is the same on every replica, so
# Megatron's loss check is a program error (of the data), not a device fault.
BAD_SAMPLE = """entries: []
bad_samples:
  - {iteration: 4, microbatch_id: 8}
"""


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("schedule, error", [
    (PROGRAM_ERROR, "megatron_recover.faults.schedule.InjectedError: failure schedule: a program "
     "error at backward of iteration 4"),
    pytest.param(BAD_SAMPLE, "megatron_recover.errors.NonFiniteLoss: found NaN in local "
                 "forward loss calculation", marks=pytest.mark.long),
], ids=["raise", "bad-sample"])
def test_a_program_error_ends_the_job_with_its_iteration_and_microbatch(tmp_path, schedule,
                                                                        error):
    """Through `megatron-recover launch`, as a user runs it: exit status 3, and the summary
    names the rank, the iteration and the microbatch."""
    run_dir = tmp_path / "program"
    run_dir.mkdir()
    (run_dir / "schedule.yaml").write_text(schedule)
    log = run_dir / "log.jsonl"
    command = [str(Path(sys.executable).parent / "megatron-recover"), "launch", "-n",
               str(REPLICAS), "--status-dir", str(run_dir / "status"), "--", *ENTRY, *MODEL,
               "--recover", "--recover-log", str(log),
               "--recover-failure-schedule", str(run_dir / "schedule.yaml")]
    returncode, output, _ = run_bounded(command, dict(os.environ), TIMEOUT_S)
    assert returncode == PROGRAM_ERROR_EXIT, (returncode, output[-4000:])
    # Replica 2 runs ids 8-11 of the failure-free layout (B = 20, 4 per replica).
    assert "rank 2 ends the job: a program error in iteration 4, microbatch 8" in output, (
        output[-4000:])
    assert error in output, output[-4000:]
    assert ("a program error on rank 2 ended the job in iteration 4, microbatch 8: "
            f"{error.split(':')[0]}") in output, output[-2000:]
    statuses = read_statuses(run_dir / "status")
    rank, status = program_error(statuses)
    assert (rank, status["iteration"], status["microbatch_id"]) == (2, 4, 8), status
    # Nobody else stopped on its own: no survivor reran the microbatch, no replica was lost.
    assert all(s["state"] == "running" for r, s in statuses.items() if r != 2), statuses
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert not [e for r in records for e in r["events"]]


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_program_errors_survive_when_asked(tmp_path, reference):
    run = train(tmp_path, "survive", ["--recover-program-errors", "survive"], PROGRAM_ERROR)
    status = run.result.statuses[2]
    assert (status["state"], status["kind"]) == ("left", "program"), status
    failed = [(r["iteration"], e["replicas"]) for r in run.records for e in r["events"]
              if e["event"] == "failure"]
    assert failed == [(4, [2])]
    assert_ledger_held(run.records, 20)
    assert_exact(run, reference, "program error, --recover-program-errors survive")
