"""Hangs become fail-stop: frozen ranks (SIGSTOP) are declared failed within the hang bound and
handled like crashes; a healthy rank computing 3x the bound, or a slow oversubscribed start-up,
is not declared failed.

Run: `make test`. CPU only; each run under a hard timeout. --recover-hang-timeout is 3 s here.
Detection times go to the test log (even without `-s`): from the freeze (the victim's marker) to the survivors'
verdict, and the logged time since the victim's last observed progress.
"""

import json

import pytest
import torch

from megatron_recover.faults import read_markers
from megatron_recover.launch import LaunchConfig, launch
from tests.mpirun_harness import ENTRY
from tests.training_harness import (
    EXACT_LOSS_RTOL,
    EXACT_PARAM_RTOL,
    STABLE_LR,
    assert_ledger_held,
    param_rdiff,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
HANG_S = 3.0
TIMEOUT_S = 240
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--eval-iters", "0",
       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
       *STABLE_LR, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--log-interval", "1",
       "--recover", "--recover-hang-timeout", str(HANG_S)]


def train(tmp_path, ranks, extra, schedule=None):
    log = tmp_path / "log.jsonl"
    if schedule is not None:
        (tmp_path / "schedule.yaml").write_text("entries:\n" + "".join(
            f"  - {entry}\n" for entry in schedule))
        extra = [*extra, "--recover-failure-schedule", str(tmp_path / "schedule.yaml")]
    result = launch(LaunchConfig(ranks, [*ENTRY, *JOB, "--recover-log", str(log), *extra],
                                 tmp_path / "status", TIMEOUT_S))
    assert not result.timed_out, f"hung\n{result.output[-4000:]}"
    assert result.succeeded, result.output[-4000:]
    return result, [json.loads(line) for line in log.read_text().splitlines()], log


def freeze_to_commit(records, log) -> list[float]:
    """Seconds from each victim's freeze (its marker) to the commit of its iteration."""
    freezes = {m["iteration"]: m["time"] for m in read_markers(log.with_suffix(".markers.jsonl"))}
    return [record["committed_s"] - freezes[record["iteration"]] for record in records
            if record["iteration"] in freezes]


def detection_delays(records, log) -> list[float]:
    """Seconds from each victim's freeze (its marker) to the survivors' detection."""
    freezes = {m["iteration"]: m["time"] for m in read_markers(log.with_suffix(".markers.jsonl"))}
    return [event["detected"] - freezes[record["iteration"]]
            for record in records for event in record["events"] if event["event"] == "failure"]


def report(capsys, line: str) -> None:
    """Into the test log as it runs (CI's log shows detection times)."""
    with capsys.disabled():
        print(f"\n  {line}", flush=True)


def data_plane(output: str) -> str:
    return "torch" if "cross-replica data plane: torch" in output else "mpi"


def since_last_progress(records) -> list[float]:
    return [event["since_last_progress_s"] for record in records for event in record["events"]
            if event["event"] == "failure"]


def assert_same_curve(records, reference, run_dir, survivors):
    """Exact against the failure-free run: losses, the ledger, the survivors' parameters."""
    diffs = [abs(r["loss"] - ref["loss"]) / ref["loss"] for r, ref in zip(records, reference)]
    assert len(records) == len(reference) and max(diffs) <= EXACT_LOSS_RTOL, diffs
    assert_ledger_held(records, records[0]["B"])
    for rank in survivors:
        params = torch.load(run_dir / "hang" / "status" / f"rank-{rank}.params.pt")
        expected = torch.load(run_dir / "ref" / "status" / f"rank-{rank}.params.pt")
        assert param_rdiff(params, expected) <= EXACT_PARAM_RTOL, rank


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_frozen_ranks_are_declared_failed(tmp_path, capsys):
    """DP=4: one replica freezes during backward, another inside a bucket reduce."""
    job = ["--global-batch-size", "16", "--train-iters", "8"]
    (tmp_path / "ref").mkdir()
    _, reference, _ = train(tmp_path / "ref", 4, job)
    (tmp_path / "hang").mkdir()
    result, records, log = train(tmp_path / "hang", 4, job, [
        "{iteration: 3, replica: 2, local_rank: 0, location: backward, action: stop}",
        "{iteration: 6, replica: 1, local_rank: 0, location: during-reduce, action: stop}"])
    assert [m["rank"] for m in read_markers(log.with_suffix(".markers.jsonl"))] == [2, 1]
    assert [r["live_replicas"] for r in records] == [4, 4, 3, 3, 3, 2, 2, 2]
    delays = detection_delays(records, log)
    report(capsys, f"frozen rank -> failure declared after "
                   f"{', '.join(f'{d:.2f}' for d in delays)} s (hang timeout {HANG_S:g} s); "
                   f"since last progress: "
                   f"{', '.join(f'{s:.2f}' for s in since_last_progress(records))} s; "
                   f"to the commit: {', '.join(f'{c:.2f}' for c in freeze_to_commit(records, log))}"
                   f" s ({data_plane(result.output)} data plane)")
    assert len(delays) == 2 and all(d <= HANG_S + 3 for d in delays), delays
    # Open MPI declares a rank failed (T - period, T] after its last heartbeat: a hang, while a
    # crash is detected within an iteration (tens of ms).
    assert all(s >= HANG_S / 4 for s in since_last_progress(records))
    assert {result.statuses[r]["state"] for r in (0, 3)} == {"completed"}
    assert_same_curve(records, reference, tmp_path, (0, 3))


@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_frozen_rank_takes_its_replica_down(tmp_path, capsys):
    """TP=2 x DP=2: local rank 1 of replica 1 freezes; its peer, blocked in a TP collective,
    leaves by itself within the bound; replica 0 goes on."""
    job = ["--global-batch-size", "8", "--train-iters", "6", "--tensor-model-parallel-size", "2"]
    (tmp_path / "ref").mkdir()
    _, reference, _ = train(tmp_path / "ref", 4, job)
    (tmp_path / "hang").mkdir()
    result, records, log = train(tmp_path / "hang", 4, job, [
        "{iteration: 3, replica: 1, local_rank: 1, location: backward, action: stop}"])
    delays = detection_delays(records, log)
    report(capsys, f"TP=2: frozen rank -> replica lost after "
                   f"{', '.join(f'{d:.2f}' for d in delays)} s")
    assert len(delays) == 1 and delays[0] <= HANG_S + 3
    assert result.statuses[2]["state"] == "left", result.statuses[2]  # the frozen rank's peer
    assert "replica gate" in result.statuses[2]["error"], result.statuses[2]
    assert_same_curve(records, reference, tmp_path, (0, 1))


@pytest.mark.long
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_long_compute_and_oversubscribed_startup_are_not_failures(tmp_path):
    """8 ranks on this machine's cores; replica 5 computes 3x the bound without communicating."""
    result, records, log = train(tmp_path, 8, ["--global-batch-size", "16", "--train-iters", "4"],
                                 [f"{{iteration: 2, replica: 5, local_rank: 0, location: backward,"
                                  f" action: stall, seconds: {3 * HANG_S:g}}}"])
    stalls = read_markers(log.with_suffix(".markers.jsonl"))
    assert [(m["rank"], m["action"]) for m in stalls] == [(5, "stall")]
    assert records[1]["iteration_ms"] >= 3 * HANG_S * 1000  # the stall really happened
    assert all(r["live_replicas"] == 8 and not r["events"] for r in records), records
    assert {s["state"] for s in result.statuses.values()} == {"completed"}
