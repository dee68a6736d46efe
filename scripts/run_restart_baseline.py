"""Checkpoint-restart baseline: a rank dies, the job goes down, relaunches from its last checkpoint.

Usage: .venv/bin/python scripts/run_restart_baseline.py --ranks 8 --save-interval 4 \\
           --failures 6,10 --out runs/restart [--json] -- <pretrain_gpt_recover.py arguments>

What Megatron users do today when a process dies, played end to end on stock Megatron
(pretrain_gpt_recover.py without --recover, megatron-core distributed checkpoints):

- Launch: `--save OUT/checkpoints --save-interval N --load OUT/checkpoints`, so every launch
  resumes from the newest complete checkpoint (the first starts from scratch). Over gloo (the
  default) under plain `mpirun`: one death ends the whole job, as under torchrun. With
  `--cross-replica-backend ulfm`, data parallelism runs on the backend --recover uses, under
  `mpirun --with-ft ulfm`; its torch.distributed calls fail stop, so the survivors raise at the
  death and the job ends as over gloo (only the way it goes down differs).
- Failure at iteration f: as soon as iteration f begins (rank 0 printed iteration f - 1 and, if
  one was due, its checkpoint), the driver SIGKILLs one rank's process group (the rank and its
  checkpoint-writer helpers: a node going down). The kill lands at the start of iteration f,
  before its gradient synchronization: the driver sees the job only through its output, and the
  lost part of iteration f is at most one iteration either way.
- Job down: mpirun notices the death and takes the other ranks down (over ulfm, the survivors
  raise at the death and exit). Bounded: after --handling-timeout seconds the driver kills the
  job's processes itself (counted as handling).
- Relaunch at once with the same command; the job redoes the iterations after its checkpoint.

Timestamps per failure, as the ReCoVer paper's appendix A.1 defines them (rank 0's wall clock for
what happens inside the job, the driver's for kills and exits: the same machine's clock):
  A/B  start/end of the save of the checkpoint the restart resumes from
  C    the kill;  D  the job is down and the relaunch starts
  E/F  start/end of the checkpoint load;  G = F, training resumes
  H    iteration f completes again
Phases: checkpoint save B-A, run before failure C-B, failure handling D-C, restart
initialization E-D (process start, imports, model build), checkpoint load F-E, rerun H-G.
Iteration completions are stamped when rank 0's line reaches the driver.
"""

import argparse
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_recover.launch import LaunchConfig, RunningJob, read_statuses  # noqa: E402

ENTRY = [sys.executable, str(ROOT / "pretrain_gpt_recover.py")]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")
LOSS = re.compile(r"lm loss: ([0-9.]+E[+-]\d+)")
SPAN = r"\[ [0-9.]+ s, wall ([0-9.]+) -> ([0-9.]+) \]"
SAVED = re.compile(r"successfully saved checkpoint from iteration\s+(\d+) to .* " + SPAN)
LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration\s+(\d+) " + SPAN)
NOTHING_TO_LOAD = re.compile(r"no checkpoint in .*: training starts from iteration 1 " + SPAN)
POLL_S = 0.01


@dataclass
class StampedOutput:
    """A job's output lines, each with the driver's time.time() when it arrived."""

    lines: list[tuple[float, str]] = field(default_factory=list)

    def iterations(self) -> list[tuple[float, int, float | None]]:
        """(arrival time, iteration, loss or None) of every iteration line of one launch, in
        order. The loss is None where no line shows that iteration's alone: a skipped step's,
        and the launch's second line, which averages its first iteration in again (Megatron-LM's
        first line starts no interval; the job logs every iteration)."""
        found = []
        for t, line in self.lines:
            match = ITERATION.search(line)
            if match:
                loss = LOSS.search(line)
                alone = loss is not None and len(found) != 1
                found.append((t, int(match.group(1)), float(loss.group(1)) if alone else None))
        return found

    def text(self) -> str:
        return "".join(line for _, line in self.lines)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class BaselineConfig:
    """One checkpoint-restart run."""

    ranks: int
    job: list[str]
    """pretrain_gpt_recover.py arguments, without --save/--load/--save-interval/--recover."""
    train_iters: int
    save_interval: int
    failures: list[int]
    """Iterations at whose start one rank is killed, each once."""
    out: Path
    victims: list[int] | None = None
    """The rank killed at each failure (default: the last rank, then the one before, ...)."""
    attempt_timeout_s: float = 900.0
    handling_timeout_s: float = 60.0
    cross_replica_backend: str = "gloo"
    """The data-parallel group's backend; "ulfm" as under --recover (its torch.distributed
    calls fail stop, so the job stops at a death as over gloo)."""

    def check(self) -> None:
        if any(f < 2 or f > self.train_iters for f in self.failures):
            raise ValueError(f"failures must lie in 2..{self.train_iters} (a kill happens when "
                             f"iteration f begins, after iteration f - 1), got {self.failures}")
        if sorted(set(self.failures)) != list(self.failures):
            raise ValueError(f"failures must be increasing and distinct, got {self.failures}")
        if self.victims is not None and len(self.victims) != len(self.failures):
            raise ValueError("give one victim rank per failure")
        if any(not 0 <= v < self.ranks for v in self.victim_ranks()):
            raise ValueError(f"victim ranks must lie in 0..{self.ranks - 1}")
        if self.cross_replica_backend not in ("gloo", "ulfm"):
            raise ValueError("cross_replica_backend: gloo or ulfm")
        if {"--save", "--load", "--save-interval", "--recover",
                "--cross-replica-backend"} & set(self.job):
            raise ValueError("the driver adds --save/--load/--save-interval and "
                             "--cross-replica-backend itself, and the baseline is stock "
                             "Megatron: drop them and --recover from the job")

    def victim_ranks(self) -> list[int]:
        if self.victims is not None:
            return list(self.victims)
        return [(self.ranks - 1 - k) % self.ranks for k in range(len(self.failures))]


class _Watcher:
    """Reads one attempt's lines; kills the victim when a pending failure's iteration begins."""

    def __init__(self, cfg: BaselineConfig, pending: list[int], victims: list[int], job_ref):
        self.cfg = cfg
        self.pending = pending  # shared with the driver: failures not yet injected
        self.victims = victims
        self.job_ref = job_ref  # [RunningJob], set right after the launch
        self.completed = None  # last iteration whose line (and due save) is done
        self.saves: dict[int, tuple[float, float, float]] = {}  # start, end, line arrived
        self.load: tuple[int, float, float] | None = None
        self.kill: dict | None = None
        self.lock = threading.Lock()

    def _save_due(self, iteration: int) -> bool:
        return iteration % self.cfg.save_interval == 0 or iteration == self.cfg.train_iters

    def __call__(self, now: float, line: str) -> None:
        with self.lock:
            if (m := SAVED.search(line)) is not None:
                self.saves[int(m.group(1))] = (float(m.group(2)), float(m.group(3)), now)
                self._begun(int(m.group(1)), now)
            elif (m := LOADED.search(line)) is not None:
                self.load = (int(m.group(1)), float(m.group(2)), float(m.group(3)))
                self._begun(int(m.group(1)), now)
            elif (m := NOTHING_TO_LOAD.search(line)) is not None:
                self.load = (0, float(m.group(1)), float(m.group(2)))
            elif (m := ITERATION.search(line)) is not None:
                iteration = int(m.group(1))
                if not self._save_due(iteration):
                    self._begun(iteration, now)

    def _begun(self, done: int, now: float) -> None:
        """Iteration `done` + 1 has begun: kill if a failure is due there."""
        self.completed = done
        if self.kill is not None or not self.pending or self.pending[0] != done + 1:
            return
        failure = self.pending.pop(0)
        victim = self.victims[len(self.cfg.failures) - len(self.pending) - 1]
        pid = self.job_ref[0].kill_rank(victim)
        self.kill = {"iteration": failure, "rank": victim, "pid": pid, "time": time.time(),
                     "iteration_began": now}


def _attempt(cfg: BaselineConfig, index: int, pending: list[int], progress) -> dict:
    """Launch once; return what happened (lines, saves, load, kill, times)."""
    ckpt = cfg.out / "checkpoints"
    command = [*ENTRY, *cfg.job, "--train-iters", str(cfg.train_iters), "--save", str(ckpt),
               "--save-interval", str(cfg.save_interval), "--load", str(ckpt)]
    if cfg.cross_replica_backend == "ulfm":
        command += ["--cross-replica-backend", "ulfm"]
    launch_cfg = LaunchConfig(cfg.ranks, command, cfg.out / f"status-{index}",
                              timeout_s=cfg.attempt_timeout_s)
    job_ref = []
    watcher = _Watcher(cfg, pending, cfg.victim_ranks(), job_ref)
    # Over ulfm, ULFM must be on (the backend refuses otherwise); the job still stops at a
    # death, its survivors failing stop. Over gloo, plain mpirun takes the job down.
    job = RunningJob(launch_cfg, fault_tolerant=cfg.cross_replica_backend == "ulfm",
                     on_line=watcher)
    job_ref.append(job)
    down = _wait_down(job, watcher, cfg)
    # Whatever is left (a forced teardown, ranks' checkpoint-writer helpers) goes before the
    # relaunch; the job counted as down already.
    job.kill_everything()
    output = StampedOutput(list(job.lines))
    (cfg.out / f"attempt-{index}.txt").write_text(output.text())
    if down is None:
        raise SystemExit(f"attempt {index} timed out after {cfg.attempt_timeout_s:.0f}s; "
                         f"output in {cfg.out}/attempt-{index}.txt")
    record = {"attempt": index, "launched": job.started, "down": down[0],
              "down_forced": down[1]}
    statuses = read_statuses(launch_cfg.status_dir)
    record.update(
        iterations=[{"time": t, "iteration": i, "loss": loss}
                    for t, i, loss in output.iterations()],
        saves={str(i): {"start": s, "end": e, "line_arrived": a}
               for i, (s, e, a) in sorted(watcher.saves.items())},
        load=(None if watcher.load is None else
              {"iteration": watcher.load[0], "start": watcher.load[1], "end": watcher.load[2]}),
        kill=watcher.kill,
        completed=watcher.kill is None and any(s.get("state") == "completed"
                                               for s in statuses.values()),
        errors=[s["error"][-500:] for s in statuses.values() if s.get("state") == "error"])
    if watcher.kill is None and not record["completed"]:
        raise SystemExit(f"attempt {index} ended without completing and without a kill; "
                         f"output in {cfg.out}/attempt-{index}.txt")
    progress(_attempt_summary(record))
    return record


def _wait_down(job: RunningJob, watcher: _Watcher,
               cfg: BaselineConfig) -> tuple[float, bool] | None:
    """Wait until mpirun and every rank process are gone: (that time, whether the driver had to
    force it after --handling-timeout), or None if the attempt outlived its timeout."""
    deadline = job.started + cfg.attempt_timeout_s
    while time.time() < deadline:
        now = time.time()
        if job.proc.poll() is not None and not any(map(_alive, job.rank_pids().values())):
            return now, False
        if watcher.kill is not None and now > watcher.kill["time"] + cfg.handling_timeout_s:
            return now, True
        time.sleep(POLL_S)
    return None


def _attempt_summary(record: dict) -> str:
    its = [r["iteration"] for r in record["iterations"]]
    span = f"iterations {its[0]}..{its[-1]}" if its else "no iterations"
    load = record["load"]
    resumed = f"resumed from iteration {load['iteration']}" if load and load["iteration"] else \
        "started from scratch"
    if record["kill"]:
        k = record["kill"]
        return (f"  attempt {record['attempt']}: {resumed}, {span}; killed rank {k['rank']} "
                f"as iteration {k['iteration']} began; down "
                f"{record['down'] - k['time']:.2f}s later")
    return f"  attempt {record['attempt']}: {resumed}, {span}; completed"


def breakdown(attempts: list[dict]) -> list[dict]:
    """Appendix A.1 phases of every failure (see the module docstring), in seconds."""
    phases = []
    for i, (before, after) in enumerate(zip(attempts, attempts[1:])):
        kill, load = before["kill"], after["load"]
        redo = [r["time"] for r in after["iterations"] if r["iteration"] == kill["iteration"]]
        entry = {"failure_iteration": kill["iteration"], "resumed_from": load["iteration"],
                 "kill_after_iteration_began_s": kill["time"] - kill["iteration_began"],
                 "failure_handling_s": before["down"] - kill["time"],
                 "restart_initialization_s": load["start"] - before["down"],
                 "checkpoint_load_s": load["end"] - load["start"],
                 "rerun_s": redo[0] - load["end"] if redo else None}
        # The save the restart resumed from: the last attempt up to the failure that wrote it.
        saves = [a["saves"][str(load["iteration"])] for a in attempts[:i + 1]
                 if str(load["iteration"]) in a["saves"]]
        if saves:
            entry["checkpoint_save_s"] = saves[-1]["end"] - saves[-1]["start"]
            entry["run_before_failure_s"] = kill["time"] - saves[-1]["end"]
        phases.append(entry)
    return phases


def output_delay(attempts: list[dict]) -> dict | None:
    """How late rank 0's lines reach the driver (its checkpoint lines carry their own time):
    the error of the iteration stamps and of the kill's placement."""
    delays = sorted(save["line_arrived"] - save["end"] for attempt in attempts
                    for save in attempt["saves"].values())
    if not delays:
        return None
    return {"median": delays[len(delays) // 2], "max": delays[-1], "samples": len(delays)}


def run_baseline(cfg: BaselineConfig, progress=print) -> dict:
    """Run until train_iters are done, relaunching after each injected failure."""
    cfg.check()
    cfg.out.mkdir(parents=True, exist_ok=True)
    if (cfg.out / "checkpoints").exists():
        raise ValueError(f"{cfg.out}/checkpoints exists: give a fresh --out")
    pending = list(cfg.failures)
    attempts = []
    while True:
        record = _attempt(cfg, len(attempts), pending, progress)
        attempts.append(record)
        if record["completed"]:
            break
        if len(attempts) > len(cfg.failures) + 1:
            raise SystemExit("more launches than failures: the job does not make progress")
    result = {"ranks": cfg.ranks, "train_iters": cfg.train_iters,
              "save_interval": cfg.save_interval, "failures": cfg.failures,
              "launches": len(attempts), "wall_s": attempts[-1]["down"] - attempts[0]["launched"],
              "breakdown": breakdown(attempts), "output_delay_s": output_delay(attempts),
              "attempts": attempts}
    (cfg.out / "timeline.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--train-iters", type=int, required=True)
    parser.add_argument("--save-interval", type=int, required=True)
    parser.add_argument("--failures", required=True,
                        help="comma-separated iterations at whose start a rank dies")
    parser.add_argument("--victims", default=None, help="comma-separated ranks, one per failure")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--attempt-timeout", type=float, default=900.0)
    parser.add_argument("--handling-timeout", type=float, default=60.0)
    parser.add_argument("--cross-replica-backend", choices=["gloo", "ulfm"], default="gloo",
                        help="the data-parallel group's backend")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("job", nargs=argparse.REMAINDER,
                        help="-- then pretrain_gpt_recover.py arguments (no --train-iters)")
    args = parser.parse_args()
    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    cfg = BaselineConfig(
        ranks=args.ranks, job=job, train_iters=args.train_iters, save_interval=args.save_interval,
        failures=[int(f) for f in args.failures.split(",") if f],
        victims=[int(v) for v in args.victims.split(",")] if args.victims else None,
        out=args.out.resolve(), attempt_timeout_s=args.attempt_timeout,
        handling_timeout_s=args.handling_timeout,
        cross_replica_backend=args.cross_replica_backend)
    try:
        result = run_baseline(cfg, progress=(lambda s: print(s, file=sys.stderr, flush=True))
                              if args.json else print)
    except ValueError as error:
        parser.error(str(error))
    summary = {k: v for k, v in result.items() if k != "attempts"}
    if args.json:
        print(json.dumps(summary))
    else:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
