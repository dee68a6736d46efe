"""Node loss on three fake nodes of this machine (megatron_recover.testing.nodes), 2 ranks each.

A rank's death on a remote node is survived in-step. A lost node (whole, its daemon only, or
silent: link down) ends the job within the launcher's bound; `megatron-recover launch`
relaunches on the other nodes (or on a spare) and the ranks resume from the newest in-memory
snapshot the survivors hold in full, after which the run equals the failure-free one: every
iteration's loss (the last record of each) and the final parameters. A snapshot torn by the
loss is never loaded. Nothing is left behind: no process in the nodes' namespaces, no ssh
stand-in, no network device.

Run: `make test` as root (skipped, with the reason, without root, unshare, nsenter or ip). CPU
only; 6 oversubscribed ranks; every job is bounded and the harness kills only what it started.
"""

import json
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_recover import relaunch
from megatron_recover.launch import default_snapshot_dir
from megatron_recover.faults import read_markers
from megatron_recover.testing.nodes import AGENT, FakeNodes, unavailable_reason
from tests.mpirun_harness import ENTRY
from tests.test_checkpoint import JOB as SMALL_GPT
from tests.training_harness import EXACT_LOSS_RTOL, EXACT_PARAM_RTOL, loss_rdiff, param_rdiff

pytestmark = [pytest.mark.mpi, pytest.mark.e2e, pytest.mark.root,
              pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=unavailable_reason() or "")]
ITERATIONS = 10
INTERVAL = 2
# The launcher's stall bound for the silent loss (--stall-timeout): the default, 11 x the hang
# timeout, is 11 minutes at the default 60 s, and shorter hang timeouts (3-8 s) were seen here to
# declare live ranks dead while 6 ranks start on 2 cores. The detector can declare a silent peer
# dead from timeout - period after the loss (the last heartbeat may be a period old; its period
# is a quarter of the timeout): from 45 s at 60 s, which races the bound (a repair that then
# returns finishes the run in-step and only mpirun waits). At SILENT_HANG_S not before 90 s: the
# silent case the watchdog alone must end.
SILENT_STALL_S = 45.0
SILENT_HANG_S = 120.0
KILL_AFTER = 5  # the node is lost once this iteration has committed
# A rank of nodeC computes this long, without communication, in iteration KILL_AFTER + 1, and
# the node is lost once it has begun: the loss lands inside that iteration. Without it the run
# was seen to complete before the loss (0.13-0.3 s per iteration here; CI saw all ranks complete
# before nodeC's daemon was killed). The relaunch runs without it (entries fire again on a
# relaunch, and replica 4 is back with a spare host).
LOSS_STALL_S = 30
LOSS_INSIDE_AN_ITERATION = dict(
    schedule=(f"entries:\n  - {{iteration: {KILL_AFTER + 1}, replica: 4, local_rank: 0,"
              f" location: pre-forward, action: stall, seconds: {LOSS_STALL_S}}}\n"),
    wait_for_markers=1, schedule_after_loss="entries: []\n")
RANKS_PER_NODE = 2
TEARDOWN_S = 15.0  # mpirun's teardown, then this launcher's clean-up
TIMEOUT_S = 300
JOB = [*SMALL_GPT, "--train-iters", str(ITERATIONS), "--recover-snapshot-interval",
       str(INTERVAL)]


@pytest.fixture
def shared_dir():
    """The job's files, where every fake node sees them (each has its own /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="megatron-recover-nodes-test-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)

def _iteration(status_dir: Path) -> int:
    return relaunch.read_progress(status_dir).get("iteration", 0)



@dataclass
class Job:
    stall_timeout_s: float  # the launcher's bound
    attempts: list[relaunch.Attempt]
    records: dict[int, dict]  # the last record of each iteration
    markers: list[dict]
    killed_at: float | None  # time.time() of the node loss
    killed_after: int | None  # the newest committed iteration then
    torn: list[str]  # snapshot files being written on this machine at the node loss
    leftovers: dict
    status_root: Path

    def params(self, attempt: int, rank: int) -> dict:
        return torch.load(self.status_root / f"attempt-{attempt}" / f"rank-{rank}.params.pt")

    def resumed_iteration(self) -> int:
        last = self.attempts[-1]
        lines = [line for _, line in last.lines
                 if "resumed iteration" in line and "in-memory snapshots" in line]
        # What it did instead: every attempt's summary and the relaunch's start-up lines.
        assert lines, ("the relaunch did not resume from the snapshots:\n"
                       + "\n".join(a.summary() for a in self.attempts) + "\n"
                       + "".join(f"\n  | {line.rstrip()}" for _, line in last.lines
                                 if "megatron-recover" in line)[-4000:])
        return int(lines[0].split("resumed iteration")[1].split()[0])


def run_job(work: Path, nodes: FakeNodes, hosts: list[str], lose=None, spares=(),
            schedule: str | None = None, wait_for_markers: int = 0,
            stall_timeout_s: float | None = None, extra: tuple[str, ...] = (),
            schedule_after_loss: str | None = None) -> Job:
    """The job on `hosts` under the relaunching launcher; `lose(name)` (a FakeNodes method)
    takes node nodeC once iteration KILL_AFTER has committed (and, with `wait_for_markers`,
    that many markers are written). `schedule_after_loss` replaces the failure schedule then,
    for the relaunch (which reads it at its start-up)."""
    log = work / "log.jsonl"
    command = [*ENTRY, *JOB, *extra, "--recover", "--recover-log", str(log)]
    if schedule is not None:
        (work / "schedule.yaml").write_text(schedule)
        command += ["--recover-failure-schedule", str(work / "schedule.yaml")]
    status_root = work / "status"
    loss = {"at": None, "after": None, "torn": []}

    def on_start(attempt, job):
        if lose is None or attempt.number != 1:
            return

        def watch():
            markers = log.with_suffix(".markers.jsonl")
            while attempt.ended == 0.0:
                if (_iteration(status_root / "attempt-1") >= KILL_AFTER
                        and len(read_markers(markers)) >= wait_for_markers):
                    loss["after"] = _iteration(status_root / "attempt-1")
                    loss["torn"] = [str(p) for p in
                                    Path("/dev/shm").glob("megatron-recover-*/iter_*/*.tmp")]
                    loss["at"] = time.time()
                    lose("nodeC")
                    if schedule_after_loss is not None:
                        (work / "schedule.yaml").write_text(schedule_after_loss)
                    return
                time.sleep(0.02)

        threading.Thread(target=watch, daemon=True).start()

    cfg = relaunch.JobConfig(
        command=command, hosts=hosts, ranks_per_host=RANKS_PER_NODE, status_root=status_root,
        spare_hosts=list(spares), max_relaunches=1, timeout_s=TIMEOUT_S,
        stall_timeout_s=stall_timeout_s, ssh_agent=str(AGENT), network=nodes.cidr,
        env=tuple(nodes.env.items()))
    attempts = relaunch.run_job(cfg, on_start=on_start)
    deadline = time.monotonic() + 10.0  # orphaned ranks of a lost daemon exit within ~1 s
    while (nodes.leftovers()["processes"] or nodes.leftovers()["agents"]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    records = {}
    for record in map(json.loads, log.read_text().splitlines()):
        records[record["iteration"]] = record  # a relaunch rewrites the iterations it redoes
    return Job(stall_timeout_s or relaunch.stall_timeout(command), attempts, records,
               read_markers(log.with_suffix(".markers.jsonl")),
               loss["at"], loss["after"], loss["torn"], nodes.leftovers(), status_root)


@pytest.fixture(scope="module")
def reference():
    """The failure-free run on the three nodes: its records and final parameters."""
    work = Path(tempfile.mkdtemp(prefix="megatron-recover-nodes-ref-", dir="/var/tmp"))
    try:
        with FakeNodes(["nodeB", "nodeC"]) as nodes:
            job = run_job(work, nodes, nodes.hosts)
        assert len(job.attempts) == 1 and job.attempts[0].succeeded, job.attempts[0].summary()
        assert sorted(job.records) == list(range(1, ITERATIONS + 1))
        yield job.records, job.params(1, 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def assert_equals_reference(job: Job, reference, label: str, figures) -> None:
    records, params = reference
    assert sorted(job.records) == sorted(records)
    assert all(r["contributions"] == r["B"] and r["invariant_ok"] for r in job.records.values())
    loss = loss_rdiff([job.records[t] for t in sorted(records)],
                      [records[t] for t in sorted(records)])
    last = job.attempts[-1]
    completed = [r for r, s in last.statuses.items() if s.get("state") == "completed"]
    assert completed, last.summary()
    assert not default_snapshot_dir(last.run_id).exists()  # freed on this machine
    digests = {last.statuses[r]["param_digest"] for r in completed}
    assert len(digests) == 1, "the replicas' final parameters differ"
    rdiff = max(param_rdiff(job.params(len(job.attempts), r), params) for r in completed)
    figures.append(f"node loss, {label}: loss vs failure-free {loss:.2e}, parameters "
                   f"{rdiff:.2e}")
    assert loss <= EXACT_LOSS_RTOL and rdiff <= EXACT_PARAM_RTOL, (loss, rdiff)


def assert_relaunched(job: Job, lost_reason, hosts: list[str], figures, label) -> int:
    """The first attempt ended within the bound with nodeC found lost; the second ran on
    `hosts` and resumed from a snapshot at most one interval before the loss. `lost_reason`
    judges the evidence the launcher gives for nodeC."""
    first, second = job.attempts
    assert job.killed_at is not None, "the node was never lost"
    assert not first.succeeded and list(first.lost) == ["nodeC"], first.summary()
    assert lost_reason(first.lost["nodeC"]), first.summary()
    ended_s = first.ended - job.killed_at
    bound_s = job.stall_timeout_s + TEARDOWN_S
    assert ended_s <= bound_s, f"the job took {ended_s:.1f} s to end"
    assert second.succeeded and second.hosts == hosts, second.summary()
    assert [s["state"] for s in second.statuses.values()] == ["completed"] * 2 * len(hosts), (
        second.summary(), [e for r in job.records.values() for e in r.get("events", [])])
    resumed = job.resumed_iteration()
    figures.append(f"node loss, {label}: job ended {ended_s:.2f} s after the loss (bound "
                   f"{bound_s:g} s); lost after iteration {job.killed_after}, resumed from the "
                   f"snapshot of iteration {resumed}")
    # Survivors may commit more iterations before the runtime ends them (never fewer snapshots).
    assert resumed >= job.killed_after - INTERVAL
    assert job.leftovers == {"processes": [], "agents": []}, job.leftovers
    return resumed


def assert_lost_inside_an_iteration(job: Job) -> None:
    """The nodeC rank's long computation began (its marker) and the node was lost during it."""
    first = job.attempts[0]
    assert [(m["rank"], m["iteration"]) for m in job.markers] == [(4, KILL_AFTER + 1)], \
        first.summary()
    assert job.killed_after == KILL_AFTER, (job.killed_after, first.summary())
    assert job.killed_at - job.markers[0]["time"] < LOSS_STALL_S


@pytest.mark.long
@pytest.mark.timeout(TIMEOUT_S + 120)
def test_rank_on_a_remote_node_dies_in_step(shared_dir, reference, figures):
    """No relaunch: ULFM survives a rank's death on nodeC (replica 4) in-step, exactly."""
    with FakeNodes(["nodeB", "nodeC"]) as nodes:
        job = run_job(shared_dir, nodes, nodes.hosts, schedule=(
            "entries:\n  - {iteration: 3, replica: 4, local_rank: 0, location: during-reduce}\n"))
        links_before_down = nodes.links()
    assert [(m["rank"], m["iteration"], m["location"]) for m in job.markers] == [
        (4, 3, "during-reduce")]
    assert len(job.attempts) == 1 and job.attempts[0].succeeded, job.attempts[0].summary()
    assert job.records[3]["live_replicas"] == 5 and job.records[ITERATIONS]["live_replicas"] == 5
    assert job.leftovers == {"processes": [], "agents": []} and len(links_before_down) == 3
    assert nodes.links() == []
    assert_equals_reference(job, reference, "a rank on nodeC, in-step", figures)


def unreachable(evidence: str) -> bool:
    return "unreachable" in evidence


def daemon_only(evidence: str) -> bool:
    return evidence == "PRRTE lost its daemon"


LOSSES = {"whole node": ("kill_node", unreachable), "daemon only": ("kill_daemon", daemon_only)}


# make test-long: the relaunched attempt of the whole-node case has hung on an Open MPI abort
# (NBC_Progress errors 15 and 75, then SIGABRT on nodeB, attempt 2 timing out after 300 s) in
# about one run in three on this machine, and took 47-329 s: CI's budget cannot carry it.
@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S + 120)
@pytest.mark.parametrize("loss", ["whole node", "daemon only"])
def test_node_loss_relaunches_from_snapshots(shared_dir, reference, figures, loss):
    method, reason = LOSSES[loss]
    with FakeNodes(["nodeB", "nodeC"]) as nodes:
        job = run_job(shared_dir, nodes, nodes.hosts, lose=getattr(nodes, method),
                      **LOSS_INSIDE_AN_ITERATION)
    assert_lost_inside_an_iteration(job)
    assert nodes.links() == []
    assert_relaunched(job, reason, nodes.hosts[:2], figures, loss)
    assert_equals_reference(job, reference, loss, figures)


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S + 120)
def test_a_silent_node_loss_ends_within_the_bound(shared_dir, reference, figures):
    """nodeC's link goes down, then its processes die: no connection closes and its ssh
    stand-in blocks, so mpirun never learns of it and the survivors wait. The stall watchdog
    stops the job SILENT_STALL_S after the last committed iteration; the probe finds nodeC
    unreachable and the relaunch resumes from the snapshots."""
    with FakeNodes(["nodeB", "nodeC"]) as nodes:
        job = run_job(shared_dir, nodes, nodes.hosts, lose=nodes.silence,
                      stall_timeout_s=SILENT_STALL_S,
                      extra=("--recover-hang-timeout", f"{SILENT_HANG_S:g}"),
                      **LOSS_INSIDE_AN_ITERATION)
    assert_lost_inside_an_iteration(job)
    assert nodes.links() == []
    assert job.attempts[0].stalled, job.attempts[0].summary()
    assert_relaunched(job, unreachable, nodes.hosts[:2], figures, "silent")
    assert_equals_reference(job, reference, "silent", figures)


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S + 120)
def test_a_spare_host_restores_the_replica_count(shared_dir, reference, figures):
    with FakeNodes(["nodeB", "nodeC", "nodeD"]) as nodes:
        job = run_job(shared_dir, nodes, nodes.hosts[:3], lose=nodes.kill_node,
                      spares=["nodeD"], **LOSS_INSIDE_AN_ITERATION)
    assert_lost_inside_an_iteration(job)
    hosts = [nodes.hosts[0], "nodeB", "nodeD"]
    assert_relaunched(job, unreachable, hosts, figures, "whole node, spare host")
    resumed = job.resumed_iteration()
    assert all(job.records[t]["live_replicas"] == 6 for t in range(resumed + 1, ITERATIONS + 1))
    assert_equals_reference(job, reference, "whole node, spare host", figures)


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S + 120)
def test_a_snapshot_torn_by_the_loss_is_never_loaded(shared_dir, reference, figures):
    """Every writer of iteration 6's snapshot pauses halfway; nodeC is lost meanwhile: the
    relaunch resumes from iteration 4's."""
    with FakeNodes(["nodeB", "nodeC"]) as nodes:
        job = run_job(shared_dir, nodes, nodes.hosts, lose=nodes.kill_node,
                      schedule="entries: []\nslow_snapshot_writes:\n"
                               "  - {iteration: 6, seconds: 60}\n",
                      wait_for_markers=len(nodes.hosts))
    # One writer per node (the lowest replica there): all three were inside it.
    pauses = [(m["rank"], m["iteration"]) for m in job.markers]
    assert sorted(pauses) == [(0, 6), (2, 6), (4, 6)]
    assert any("iter_0000006" in path for path in job.torn), job.torn  # on this machine too
    assert job.resumed_iteration() == 4
    assert_equals_reference(job, reference, "torn snapshot", figures)
