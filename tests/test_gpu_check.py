"""`make gpu-check` (scripts/gpu_check.sh) on a machine without a GPU.

- Its dry run: without --emulate it stops at once, exit status 2, with "no NVIDIA GPU visible:"
  on stderr and nothing on stdout (no JSON line a caller could take for a verdict), and starts no
  job.
- `--emulate` runs part (a) (the ulfm all-reduce of 1, 16 and 256 MiB, a rank killed inside each)
  and part (b) (4 one-rank replicas on one device, bf16, distributed optimizer, overlapped
  reduction, two failures, against the failure-free run) on the CPU emulation: the JSON line
  reports both passed and emulated, parts (c) and (d) skipped with their reason. About 2
  minutes here: `make test-long`.
- Parts (c) and (d), which need 4 GPUs, run their jobs and judges on the CPU (gloo, not NCCL):
  the layouts, schedules and expectations are right (`make test-long`, about a minute).
- The budget: a driver given too little time fails its parts with the reason, still prints its
  JSON line and exits 1, without starting a job.
- SIGTERM (the shell's 8-minute backstop) in the middle of a job: the driver stops the job, its
  mpirun and every rank, reports the part as interrupted and exits 1.
- The verdicts can fail: the judges, fed what a run writes with one thing wrong each (a kill that
  did not fire, one element off, survivors that differ, a failure missing from the log, a
  parameter a few bf16 steps away), say "fail".

Run: `.venv/bin/python -m pytest -p no:cacheprovider tests/test_gpu_check.py` (about 2.5 minutes;
`-m "not long"` leaves the --emulate run out: 20 s). CPU only; every command runs in its own
process group, killed on timeout.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
DRIVER = ROOT / "scripts" / "gpu_check.py"

no_gpu = pytest.mark.skipif(torch.cuda.is_available(),
                            reason="a GPU is visible here: run `make gpu-check` itself")


def environment() -> dict:
    env = dict(os.environ, GPU_CHECK_PYTHON=sys.executable)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """`command` in its own process group, killed with it after `timeout_s`."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment(), cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{command} did not finish in {timeout_s} s\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def summary_of(done: subprocess.CompletedProcess) -> dict:
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"expected one JSON line on stdout:\n{done.stdout}\n{done.stderr}"
    return json.loads(lines[0])


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie waiting for a reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@no_gpu
def test_dry_run_without_a_gpu_stops_at_once(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    done = run([str(SCRIPT), "--out", str(out)], timeout_s=120)
    elapsed = time.monotonic() - start
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == "", done.stdout
    assert done.stderr.startswith("gpu_check: no NVIDIA GPU visible: "), done.stderr
    assert "torch.cuda.is_available() False" in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists()  # nothing was started
    print(f"dry run: exit {done.returncode} after {elapsed:.1f} s: {done.stderr.strip()}")


@no_gpu
def test_a_budget_too_small_fails_the_parts_and_still_reports(tmp_path):
    done = run([sys.executable, str(DRIVER), "--emulate", "--budget-s", "5",
                "--out", str(tmp_path / "out")], timeout_s=120)
    assert done.returncode == 1, (done.stdout, done.stderr)
    summary = summary_of(done)
    assert summary["gpu_check"] == "fail" and summary["emulated"] is True
    sizes = summary["parts"]["a"]["sizes"]
    assert [s["reason"] for s in sizes.values()] == ["no time left in the budget"] * 3
    assert summary["parts"]["b"]["verdict"] == "fail"
    assert summary["parts"]["b"]["problems"] == ["reference: no time left in the budget"]
    assert {summary["parts"][p]["verdict"] for p in "cde"} == {"skipped"}
    assert not list((tmp_path / "out").rglob("status"))  # no job was started


@no_gpu
@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_sigterm_stops_the_job_and_reports(tmp_path):
    """The 8-minute backstop's SIGTERM while part (a)'s first job runs: the driver stops mpirun
    and the ranks (by their process groups and recorded PIDs) and prints its JSON line."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(DRIVER), "--emulate", "--parts", "a",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=environment(), cwd=ROOT, start_new_session=True)
    try:
        pid_file, status_dir = out / "a" / "1MiB" / "mpirun.pid", out / "a" / "1MiB" / "status"
        deadline = time.monotonic() + 90
        ranks = {}
        while time.monotonic() < deadline and len(ranks) < 4:
            ranks = {p.name: json.loads(p.read_text())["pid"]
                     for p in status_dir.glob("rank-*.json")} if status_dir.exists() else {}
            time.sleep(0.2)
        assert len(ranks) == 4, "the ranks of the first job never started"
        mpirun = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, (stdout, stderr)
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["parts"]["a"]["verdict"] == "fail"
    assert summary["parts"]["a"]["reason"] == "interrupted (SIGTERM) before it finished"
    assert not pid_file.exists()
    time.sleep(1.0)
    assert gone(mpirun) and all(gone(pid) for pid in ranks.values()), (mpirun, ranks)


@no_gpu
@pytest.mark.mpi
@pytest.mark.e2e
@pytest.mark.long
@pytest.mark.timeout(600)
def test_emulate_runs_parts_a_and_b(tmp_path, figures):
    start = time.monotonic()
    done = run([str(SCRIPT), "--emulate", "--out", str(tmp_path / "out")], timeout_s=540)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, (done.stdout, done.stderr[-4000:])
    summary = summary_of(done)
    assert summary["gpu_check"] == "pass" and summary["emulated"] is True
    assert summary["device"] == "cpu-emulation" and summary["gpus"] == 0
    parts = summary["parts"]
    a, b, c = parts["a"], parts["b"], parts["c"]
    assert a["verdict"] == "pass" and a["emulated"] is True
    assert list(a["sizes"]) == ["1MiB", "16MiB", "256MiB"]
    for size in a["sizes"].values():
        assert size["kill_fired"] and size["exact"] and size["survivors_bitwise_equal"], size
        assert len(size["survivors"]) == 3
    assert b["verdict"] == "pass" and b["emulated"] is True
    assert b["failures_fired"] == [[1, 3, "during-reduce"], [2, 5, "backward"]]
    assert b["failure_events"] == [[3, [1]], [5, [2]]]
    assert b["ledger_held"] and b["survivors_agree"] and b["exact"]
    # bf16 with fp32 gradient buffers on the CPU: bitwise (tests/test_precision.py).
    assert b["params_bitwise_equal"], b
    assert c["verdict"] == "skipped" and "--emulate" in c["reason"]
    for name in "de":
        assert parts[name]["verdict"] == "skipped" and "--emulate" in parts[name]["reason"]
    assert elapsed < 8 * 60
    line = (f"gpu_check --emulate: a {a['seconds']:.0f} s (256 MiB all-reduce "
            f"{a['sizes']['256MiB']['allreduce_s']:.2f} s), b {b['seconds']:.0f} s "
            f"(parameters bitwise equal: {b['params_bitwise_equal']}), total {elapsed:.0f} s")
    print(line)
    figures.append(line)


def driver_module():
    spec = importlib.util.spec_from_file_location("gpu_check_driver", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.long
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["c", "d", "e"])
def test_the_four_gpu_parts_pass_their_own_judges_on_the_cpu(tmp_path, name, monkeypatch):
    if os.geteuid() == 0:
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    driver = driver_module()
    part = getattr(driver, f"part_{name}")(tmp_path / name, time.monotonic() + 500, {})
    assert part["verdict"] == "pass", part.get("problems")
    assert part["exact"] and part["extension_pass_iterations"] == [3]
    assert part["survivors_agree"] is None  # one replica survives: each survivor its position


def write_allreduce_results(out: Path, victim: int, survivors: list[int]) -> None:
    """What part (a)'s ranks write when everything went right."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "markers.jsonl").write_text(json.dumps({"point": "reduce", "rank": victim,
                                                   "time": 100.0}) + "\n")

    def record(failed):
        return {"failed": failed, "failed_ranks": [victim] if failed else [], "epoch": 1,
                "size": 3, "repaired": failed, "census": []}
    for rank in survivors:
        exact = {"exact": True, "mismatched_elements": 0, "digest": "d"}
        result = {"rank": rank, "tensor_device": "cuda:0", "epoch": 1,
                  "warmup": {"record": record(False), "seconds": 0.1, **exact},
                  "hit": {"record": record(True), "seconds": 0.1, "returned_at": 100.05,
                          "untouched": True},
                  "consensus": {**record(False), "census": [len(survivors), sum(survivors)]},
                  "redo": {"record": record(False), "seconds": 0.1, "survivors": survivors,
                           **exact}}
        (out / f"result-{rank}.json").write_text(json.dumps(result))


def edit_result(out: Path, rank: int, change) -> None:
    path = out / f"result-{rank}.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_the_allreduce_judge_fails_what_is_wrong(tmp_path):
    driver = driver_module()
    run = SimpleNamespace(timed_out=False, elapsed_s=1.0)
    survivors = [0, 1, 3]

    def judged(name, change=None, markers=None):
        out = tmp_path / name
        write_allreduce_results(out, 2, survivors)
        if change is not None:
            change(out)
        if markers is not None:
            (out / "markers.jsonl").write_text(markers)
        return driver.judge_allreduce(run, out, 1, 2, emulate=False)

    good = judged("good")
    assert good["verdict"] == "pass" and good["kill_fired"] and good["exact"], good
    assert good["kill_to_failure_record_ms"] == pytest.approx(50.0)
    not_fired = judged("not-fired", markers="")
    assert not_fired["verdict"] == "fail" and not not_fired["kill_fired"]
    off_by_one = judged("inexact", lambda out: edit_result(
        out, 1, lambda d: d["redo"].update(exact=False, mismatched_elements=1)))
    assert off_by_one["verdict"] == "fail" and not off_by_one["exact"]
    differ = judged("differ", lambda out: edit_result(
        out, 3, lambda d: d["redo"].update(digest="other")))
    assert differ["verdict"] == "fail" and not differ["survivors_bitwise_equal"]
    unseen = judged("unseen", lambda out: edit_result(
        out, 0, lambda d: d["hit"]["record"].update(failed=False, failed_ranks=[])))
    assert unseen["verdict"] == "fail"
    host = judged("host", lambda out: edit_result(
        out, 0, lambda d: d.update(tensor_device="cpu")))
    assert host["verdict"] == "fail" and "not CUDA" in host["problems"][0]
    missing = judged("missing", lambda out: (out / "result-3.json").unlink())
    assert missing["verdict"] == "fail"


def test_the_training_judge_fails_what_is_wrong(tmp_path):
    """Part (b)'s judge on fabricated runs: the good one passes, each defect fails it."""
    driver = driver_module()
    weights = {"w": torch.linspace(-1, 1, 64).to(torch.bfloat16)}
    moved = {"w": weights["w"].clone()}
    moved["w"][5] += 0.125  # a few bf16 steps
    assert not torch.equal(moved["w"], weights["w"])

    def fabricated(name, params=weights, events=((3, [1]), (5, [2])), fired=None,
                   break_ledger=False, digests=("x", "x", "x"), joined=True,
                   donor_digests="d"):
        status = tmp_path / name
        status.mkdir()
        for rank in driver.B_SURVIVORS:
            torch.save({k: v.clone() for k, v in params.items()}, status / f"rank-{rank}.params.pt")
        records = []
        for i, live in enumerate(driver.B_LIVE, start=1):
            records.append({"iteration": i, "loss": 5.0 - 0.1 * i, "contributions": driver.GBS,
                            "B": driver.GBS, "invariant_ok": True, "ledger_problems": [],
                            "live_replicas": live,
                            "events": [{"event": "failure", "replicas": r} for it, r in events
                                       if it == i]})
        if joined and events:  # the standby's join after iteration 3, reported with iteration 4
            records[3]["events"].append({"event": "join", "replicas": [1], "ranks": [4],
                                         "after_iteration": 3})
        if break_ledger:
            records[2].update(invariant_ok=False, contributions=driver.GBS - 1)
        statuses = {r: {"state": "completed", "param_digest": d}
                    for r, d in zip(driver.B_SURVIVORS, digests)}
        statuses.update({1: {"state": "running"}, 2: {"state": "running"}})
        statuses[4]["joined"] = {"digests": "d", "donor_digests": donor_digests,
                                 "state_bytes": 1000}
        markers = [{"rank": r, "iteration": i, "location": loc}
                   for r, i, loc in (driver.B_FIRED if fired is None else fired)]
        return {"result": SimpleNamespace(statuses=statuses), "records": records,
                "status_dir": status, "markers": markers}

    reference = fabricated("reference", events=())

    def judge(run):
        return driver.judge_training(reference, run, driver.B_FIRED, driver.B_FAILURES,
                                     driver.B_LIVE, driver.B_SURVIVORS, joins=driver.B_JOINS,
                                     same_as=driver.B_SAME_AS)

    part, problems = judge(fabricated("good"))
    assert not problems and part["params_bitwise_equal"] and part["exact"], (part, problems)
    for name, run, expected in (
            ("moved", fabricated("moved", params=moved), "not exact"),
            ("unfired", fabricated("unfired", fired=driver.B_FIRED[:1]), "failures fired"),
            ("unlogged", fabricated("unlogged", events=((3, [1]),)), "failure events"),
            ("ledger", fabricated("ledger", break_ledger=True), "ledger invariant"),
            ("disagree", fabricated("disagree", digests=("x", "x", "y")), "differ"),
            ("no join", fabricated("no join", joined=False), "joins"),
            ("other state", fabricated("other state", donor_digests="e"),
             "does not hold its donor's state")):
        part, problems = judge(run)
        assert any(expected in p for p in problems), (name, problems)
    part, _ = judge(fabricated("moved-again", params=moved))
    assert not part["params_bitwise_equal"] and part["max_rel_param_diff"] > part["tolerance"]
