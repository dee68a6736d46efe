"""`sbatch configs/slurm_recover.sbatch` on a real Slurm cluster: slurmctld on this machine, one
slurmd in each of three fake nodes (megatron_recover.testing.slurm), Debian's Slurm 22.05.

The job (the small GPT of the node-loss tests, 2 ranks on each of node1 and node2, node3 the
spare) is submitted with the recipe's own script; what each test reads is what Slurm and the
job left: the job's steps (`squeue --steps` while it runs: mpirun's daemon on node2 is a Slurm
step named prted), its final record (`scontrol show job`) and completion record (`sacct
--completion`), its output file, the recovery log and the ranks' status files. Each test
checks that no process of the job is left on any node, and each builds its own cluster.

Run: `make test-slurm` as root (it installs the Debian packages when missing); skipped, with
the reason, without root or Slurm. Not in `make test`: it installs system packages with
apt-get, and its four jobs take about three minutes (docs/testing.md).
"""

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from megatron_recover import relaunch
from megatron_recover.faults import read_markers
from megatron_recover.testing.nodes import FakeNodes
from megatron_recover.testing.slurm import SlurmCluster, unavailable_reason
from tests.test_checkpoint import JOB as SMALL_GPT
from tests.training_harness import EXACT_LOSS_RTOL, EXACT_PARAM_RTOL, loss_rdiff, param_rdiff

pytestmark = [pytest.mark.mpi, pytest.mark.e2e, pytest.mark.root, pytest.mark.slurm,
              pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=unavailable_reason() or "")]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "configs/slurm_recover.sbatch"
NODES = ["node1", "node2", "node3"]  # two training nodes, then the spare (the allocation's last)
RANKS_PER_NODE = 2
# The fake nodes have no GPU: the command line overrides the script's --gpus-per-node=8.
SBATCH = ["--nodes=3", f"--ntasks-per-node={RANKS_PER_NODE}", "--gpus-per-node=0"]
ITERATIONS = 10
INTERVAL = 2
JOB = [*SMALL_GPT, "--recover-snapshot-interval", str(INTERVAL)]  # SMALL_GPT has --recover
TIMEOUT_S = 300
CLEAN_S = 30.0  # after the job's end, until no process of it is left on any node
KILL_AFTER = 5
# node2's first rank (replica 2) computes this long without communicating in iteration
# KILL_AFTER + 1, and node2 is lost once it has begun: the loss lands inside an iteration. The
# relaunch reads the schedule anew: at the loss it becomes STALL_AFTER_LOSS.
STALL = (f"entries:\n  - {{iteration: {KILL_AFTER + 1}, replica: 2, local_rank: 0, "
         "location: pre-forward, action: stall, seconds: 30}\n")
# The relaunch computes this long in iteration ITERATIONS - 1, so that the job still runs when
# Slurm marks node2 down (SlurmdTimeout after its last answer): what --no-kill is for.
STALL_AFTER_LOSS = (f"entries:\n  - {{iteration: {ITERATIONS - 1}, replica: 0, local_rank: 0, "
                    "location: pre-forward, action: stall, seconds: 25}\n")


@dataclass
class SlurmJob:
    id: int
    record: dict[str, str]  # scontrol's, at the end
    steps: list[tuple[float, str]]  # (time.time() first seen, `squeue --steps` line)
    completion: str
    output: str
    records: dict[int, dict]  # the last recovery-log record of each iteration
    markers: list[dict]
    run_dir: Path
    left_after_s: float  # from the job's end until no process of it was left
    wall_s: float  # from sbatch to the job's end
    events: dict = field(default_factory=dict)

    def times(self) -> str:
        return (f"{self.wall_s:.1f} s from sbatch to its end, no process of it left on any "
                f"node {self.left_after_s:.1f} s after")

    def params(self, attempt: int, rank: int) -> dict:
        return torch.load(self.run_dir / "status" / f"attempt-{attempt}" /
                          f"rank-{rank}.params.pt")

    def launcher_lines(self) -> list[str]:
        """The launcher's own lines (one may follow output that did not end its line)."""
        mark = "megatron-recover launch:"
        return [line[line.index(mark):] for line in self.output.splitlines() if mark in line]

    def step_names(self) -> list[str]:
        return [line for _, line in self.steps]


@pytest.fixture
def cluster():
    with FakeNodes(NODES) as nodes, SlurmCluster(nodes) as slurm:
        yield slurm
    assert nodes.links() == []


@pytest.fixture
def work():
    """The job's files, where every node sees them (each node has its own /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="megatron-recover-slurm-test-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def submit(cluster: SlurmCluster, work: Path, schedule: str | None = None, on_poll=None,
           iterations: int = ITERATIONS) -> SlurmJob:
    """The recipe's script through sbatch, from the repository (the job's SLURM_SUBMIT_DIR);
    waits for the job's end, then for its processes to be gone. `on_poll(job_id, run_dir,
    events)` runs on every look while it runs."""
    log, run_dir = work / "log.jsonl", work / "run"
    job = [*JOB, "--train-iters", str(iterations), "--recover-log", str(log)]
    if schedule is not None:
        (work / "schedule.yaml").write_text(schedule)
        job += ["--recover-failure-schedule", str(work / "schedule.yaml")]
    start = time.monotonic()
    job_id = cluster.sbatch(*SBATCH, f"--output={work}/slurm-%j.out", str(SCRIPT), *job,
                            cwd=ROOT, env={"RUN_DIR": str(run_dir)})
    steps, events = [], {}

    def poll(record):
        for line in cluster.steps(job_id):
            if line not in (seen for _, seen in steps):
                steps.append((time.time(), line))
        if on_poll is not None:
            on_poll(job_id, run_dir, events)

    try:
        record = cluster.wait_job(job_id, TIMEOUT_S, poll)
    except TimeoutError as e:
        raise AssertionError(f"{e}\n{_tail(work / f'slurm-{job_id}.out')}\n{cluster.logs()}")
    wall_s = time.monotonic() - start
    left_after_s = cluster.wait_no_job_processes(CLEAN_S)
    records = {}
    if log.exists():
        for line in log.read_text().splitlines():
            r = json.loads(line)
            records[r["iteration"]] = r  # a relaunch rewrites the iterations it redoes
    return SlurmJob(job_id, record, steps, cluster.completion(job_id),
                    (work / f"slurm-{job_id}.out").read_text(errors="replace"), records,
                    read_markers(log.with_suffix(".markers.jsonl")), run_dir, left_after_s,
                    wall_s, events)


def committed(run_dir: Path) -> int:
    """The newest iteration the first attempt's ranks committed (0 before the first)."""
    return relaunch.read_progress(run_dir / "status" / "attempt-1").get("iteration", 0)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path.name})"


def assert_completed(job: SlurmJob) -> None:
    assert job.record.get("JobState") == "COMPLETED" and job.record.get("ExitCode") == "0:0", (
        job.record, job.output[-3000:])
    assert job.completion.splitlines()[-1].split("|")[2:4] == ["COMPLETED", "0:0"], \
        job.completion


@pytest.fixture(scope="module")
def reference():
    """The failure-free job under Slurm: its records and rank 0's final parameters."""
    work = Path(tempfile.mkdtemp(prefix="megatron-recover-slurm-ref-", dir="/var/tmp"))
    try:
        up = time.monotonic()
        with FakeNodes(NODES) as nodes, SlurmCluster(nodes) as slurm:
            sinfo = f"up in {time.monotonic() - up:.1f} s:\n{slurm.run('sinfo').rstrip()}"
            job = submit(slurm, work)
            states = slurm.node_states()
        yield job, job.params(1, 0), (sinfo, states)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def assert_equals_reference(job: SlurmJob, reference, attempt: int, label: str, figures):
    ref, params, _ = reference
    assert sorted(job.records) == list(range(1, ITERATIONS + 1)), sorted(job.records)
    assert all(r["contributions"] == r["B"] and r["invariant_ok"] for r in job.records.values())
    loss = loss_rdiff([job.records[t] for t in sorted(ref.records)],
                      [ref.records[t] for t in sorted(ref.records)])
    statuses = job.run_dir / "status" / f"attempt-{attempt}"
    completed = sorted(int(p.name.split("-")[1].split(".")[0])
                       for p in statuses.glob("rank-*.params.pt"))
    assert completed, f"no rank of attempt {attempt} completed"
    digests = {json.loads((statuses / f"rank-{r}.json").read_text())["param_digest"]
               for r in completed}
    assert len(digests) == 1, "the replicas' final parameters differ"
    rdiff = max(param_rdiff(job.params(attempt, r), params) for r in completed)
    figures.append(f"slurm, {label}: loss vs failure-free {loss:.2e}, parameters {rdiff:.2e}")
    assert loss <= EXACT_LOSS_RTOL and rdiff <= EXACT_PARAM_RTOL, (loss, rdiff)


@pytest.mark.timeout(TIMEOUT_S + 120)
def test_the_recipe_trains_under_slurm_and_mpirun_starts_its_daemons_through_it(reference,
                                                                               figures):
    job, _, (sinfo, states) = reference
    assert sorted(states) == NODES and all(s.rstrip("*") == "idle" for s in states.values())
    figures.append(f"slurm, the cluster {sinfo}")
    assert_completed(job)
    names = job.step_names()
    # The batch script on the allocation's first node; mpirun's daemon on the other training
    # node started by Slurm (PRRTE's srun launcher), not ssh; nothing on the spare.
    assert f"{job.id}.batch batch node1" in names, names
    assert f"{job.id}.0 prted node2" in names, names
    assert not any(line.endswith("node3") for line in names), names
    assert sorted(job.records) == list(range(1, ITERATIONS + 1))
    assert all(r["live_replicas"] == 4 for r in job.records.values())
    assert job.launcher_lines()[-1].startswith("megatron-recover launch: run succeeded after "
                                               "1 attempt(s)"), job.launcher_lines()
    figures.append(f"slurm, failure-free: steps {names}; completion {job.completion!r}; "
                   f"{job.times()}")


@pytest.mark.timeout(2 * TIMEOUT_S + 120)
def test_a_rank_killed_is_survived_in_the_job_step(cluster, work, reference, figures):
    """Replica 2 (node2's first rank) dies inside iteration 3's reduction: ULFM survives it
    in-step; mpirun, its daemons' step and the job go on, and the run stays exact."""
    job = submit(cluster, work, schedule=(
        "entries:\n  - {iteration: 3, replica: 2, local_rank: 0, location: during-reduce}\n"))
    assert [(m["rank"], m["iteration"], m["location"]) for m in job.markers] == [
        (2, 3, "during-reduce")]
    assert_completed(job)
    assert [n for n in job.step_names() if " prted " in n] == [f"{job.id}.0 prted node2"]
    assert job.records[3]["live_replicas"] == 3 and job.records[ITERATIONS]["live_replicas"] == 3
    assert len([line for line in job.launcher_lines() if " attempt " in line]) == 1
    assert_equals_reference(job, reference, 1, "a rank on node2, in-step", figures)
    figures.append(f"slurm, a rank on node2, in-step: steps {job.step_names()}; {job.times()}")


@pytest.mark.timeout(2 * TIMEOUT_S + 120)
def test_a_lost_node_comes_back_on_the_spare(cluster, work, reference, figures):
    """node2 is lost inside iteration KILL_AFTER + 1 (every process in its namespace, slurmd
    included, and the node itself): mpirun ends, the launcher relaunches on node1 and the spare
    node3 from the newest in-memory snapshot, and the allocation outlives Slurm marking node2
    down (--no-kill)."""

    def lose_node2(job_id, run_dir, events):
        if "lost_at" in events:
            if "down_at" not in events and cluster.node_states().get("node2", "").startswith(
                    "down") and cluster.job(job_id).get("JobState") == "RUNNING":
                events["down_at"] = time.time()
            return
        done = committed(run_dir)
        if done >= KILL_AFTER and read_markers(work / "log.markers.jsonl"):
            events["lost_after"] = done
            events["lost_at"] = time.time()
            events["killed"] = cluster.nodes.kill_node("node2")
            (work / "schedule.yaml").write_text(STALL_AFTER_LOSS)

    job = submit(cluster, work, schedule=STALL, on_poll=lose_node2)
    assert "lost_at" in job.events, "node2 was never lost"
    assert [(m["rank"], m["iteration"]) for m in job.markers] == [(2, KILL_AFTER + 1),
                                                                  (0, ITERATIONS - 1)]
    assert job.events["lost_after"] == KILL_AFTER
    assert_completed(job)
    # Slurm marked node2 down while the job ran, and the allocation survived without it.
    assert "down_at" in job.events, "Slurm never marked node2 down while the job ran"
    assert job.record["NodeList"] == "node[1,3]", job.record
    lines = job.launcher_lines()
    assert any(line.startswith("megatron-recover launch: attempt 1 on node1,node2:")
               and "lost hosts: node2 (PRRTE lost its daemon" in line for line in lines), lines
    assert "megatron-recover launch: relaunch 1/2 on node1,node3 (4 ranks)" in lines, lines
    after = [line for t, line in job.steps if t > job.events["lost_at"]]
    assert any(line.endswith(" prted node3") for line in after), job.steps
    # The launcher asked Slurm, not ssh, whether node2 was still there.
    assert any(line.endswith(" megatron-recover-probe node2") for line in after), job.steps
    resumed = [int(line.split("resumed iteration")[1].split()[0])
               for line in job.output.splitlines() if "resumed iteration" in line]
    assert len(resumed) == 1 and KILL_AFTER - INTERVAL <= resumed[0] <= KILL_AFTER, resumed
    assert all(job.records[t]["live_replicas"] == 4 for t in range(resumed[0] + 1,
                                                                   ITERATIONS + 1))
    again = job.records[resumed[0] + 1]["time"] - job.events["lost_at"]
    steps = ", ".join(f"{line.split()[1]} on {line.split()[2]} at +{t - job.events['lost_at']:.1f}"
                      for t, line in job.steps if t > job.events["lost_at"])
    down = job.events["down_at"] - job.events["lost_at"]
    figures.append(f"slurm, node loss: node2 lost after iteration {KILL_AFTER}, relaunched on "
                   f"node1,node3 from the snapshot of iteration {resumed[0]}; steps after the "
                   f"loss (seconds, as polled): {steps}; training again (iteration "
                   f"{resumed[0] + 1} committed) {again:.1f} s after the loss; Slurm marked "
                   f"node2 down {down:.1f} s after it")
    assert_equals_reference(job, reference, 2, "node loss, relaunch on the spare", figures)
    figures.append(f"slurm, node loss: completion {job.completion!r}; {job.times()}")


@pytest.mark.timeout(TIMEOUT_S + 120)
def test_scancel_ends_every_process_of_the_job(cluster, work, figures):
    """A job long enough to be cancelled while it trains: after `scancel`, Slurm's signals
    end mpirun, its daemons, the ranks and the launcher on every node."""

    def cancel(job_id, run_dir, events):
        if "cancelled_at" in events:
            return
        if committed(run_dir) >= 2:
            events["running"] = {n: len(p) for n, p in cluster.job_processes().items()}
            events["cancelled_at"] = time.time()
            cluster.run("scancel", str(job_id))

    job = submit(cluster, work, on_poll=cancel, iterations=100_000)
    assert "cancelled_at" in job.events, "the job was never cancelled"
    assert job.events["running"]["node1"] and job.events["running"]["node2"], job.events
    assert job.record["JobState"] == "CANCELLED", job.record
    assert max(job.records) < 100_000
    ended = time.time() - job.events["cancelled_at"]
    assert not any(cluster.job_processes().values())
    figures.append(f"slurm, scancel: cancelled after iteration {max(job.records)} with "
                   f"{job.events['running']} processes running; none left on any node "
                   f"{ended:.1f} s later; completion {job.completion!r}")
