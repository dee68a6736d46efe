"""Scale run: 32 replicas of a tiny GPT lose 16 of them and keep the failure-free loss curve.

Usage: .venv/bin/python scripts/bench_scale.py [--json] [--replicas 32] [--failures N]
       [--g-init 2] [--seed 0] [--out runs/scale] [--timeout 600]

The paper's section 5 trains on 512 GPUs and loses 256 of them across the run; this is the same
shape on one CPU machine: `--replicas` replicas of one rank each (DP only, oversubscribed under
`mpirun --with-ft ulfm`), half of them killed (default `--failures` = replicas / 2). The failure
schedule is planned against the static policy itself (`plan_failures`): episodes of one or two
deaths every other iteration, cycling through the policy's cases (a failure that makes a policy
boundary, a spare that dies, a promotion, a second death inside the extension pass or the
blocking restore, a death after the commit, two at once) and through every location of
`faults.schedule.ITERATION_LOCATIONS`, those every iteration reaches (not the optimizer step's
collectives, which the fault campaign covers, nor evaluation, a join or a save). B = replicas x G_init, so once a replica is gone B is no multiple
of the live replicas and the layout has spares.

Runs the job twice, a failure-free reference and the failure run, and reports from their
per-iteration logs and the victims' markers: the ledger invariant of every iteration (B gradients
of the failure-free batches, checksum == the reference's), the failures injected and survived,
what each one did to the policy (replayed from the agreed failure records in the log), the time
from each kill to its detection, restore and commit, the largest loss difference to the
reference, the survivors' parameter digests, wall and start-up time and the ranks' peak memory
(PSS). Progress lines go to stdout, or to stderr with --json, which prints the summary; it is
also written to OUT/summary.json, beside each run's log, markers, schedule and output.

Cost at 32 replicas on 2 cores: about 14 GiB of memory (some 430 MiB PSS a rank) and 4-6 minutes,
most of it the start-up of the ranks (imports), twice. The exit status is 0 when every check holds.
"""

import argparse
import itertools
import json
import random
import shutil
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_recover.faults import read_markers  # noqa: E402
from megatron_recover.faults.schedule import (  # noqa: E402
    ITERATION_LOCATIONS,
    ScheduleEntry,
    injection_report,
    write_schedule,
)
from megatron_recover.launch import LaunchConfig, launch  # noqa: E402
from megatron_recover.policy import (  # noqa: E402
    MAJOR_SPARE,
    MINOR_SPARE,
    IterationState,
    PolicyConfig,
    PolicyDecision,
    WorkloadPolicy,
)

SPARE_ROLES = (MAJOR_SPARE, MINOR_SPARE)
# What a death does to the policy. "boundary": its uncommitted ids go back to the pool and the
# survivors recompute them in an extension pass; "promotion": a live shadow takes its place;
# "dropped": it held nothing the iteration counts (an unpromoted spare), so nothing is redone.
BOUNDARY, PROMOTION, DROPPED = "boundary", "promotion", "dropped"
ANY, SPARE = "any", "spare"  # victim kinds a plan may ask for besides BOUNDARY and PROMOTION

# Where a death lands in an iteration, as the agreed records see it: in the first record
# (detected at the iteration's reduce or consensus), in a second one (it died while the survivors
# recovered from the first), or after the commit (found by the next iteration's reduce).
FIRST_RECORD = ("pre-forward", "backward", "before-reduce", "after-post", "during-reduce",
                "during-consensus")
IN_RECOVERY = ("during-extension", "during-restore")
AFTER_COMMIT = ("optimizer-step",)
assert set(FIRST_RECORD + IN_RECOVERY + AFTER_COMMIT) == set(ITERATION_LOCATIONS)

# One episode per failure iteration, cycled until the plan has its failures: (kind, location).
# A death in recovery follows a death of the same iteration. Every failure iteration is followed
# by a quiet one (FAILURE_SPACING): a death after the commit is reported by the next iteration's
# first record, a death inside the consensus by this iteration's or the next one's (whichever
# collective notices it), and either way no other death joins its record.
EPISODES = (
    ((BOUNDARY, "during-reduce"), (ANY, "during-extension")),
    ((SPARE, "backward"),),
    ((PROMOTION, "before-reduce"), (ANY, "during-restore")),
    ((SPARE, "during-consensus"),),
    ((ANY, "optimizer-step"),),
    ((PROMOTION, "during-reduce"), (SPARE, "during-reduce")),
    ((BOUNDARY, "pre-forward"),),
    ((PROMOTION, "after-post"),),
)
FIRST_FAILURE = 2  # iteration 1 stays failure-free: ranks still starting up are joining it
FAILURE_SPACING = 2
TRAILING_ITERATIONS = 2  # failure-free iterations after the last failure


@dataclass(frozen=True)
class PlannedFailure:
    """One scheduled death and what the policy is expected to make of it."""

    entry: ScheduleEntry
    role: str  # the victim's role in the record that reports it
    effect: str  # BOUNDARY, PROMOTION or DROPPED
    record_iteration: int  # the iteration whose agreed record reports it


def _shadows(state: IterationState, replica: int) -> list[int]:
    """Live unpromoted spares that shadow `replica`'s slot (exact mode)."""
    slot = state.work[replica].slot
    return [r for r, w in state.work.items()
            if w.base_role in SPARE_ROLES and not w.contributes_first_pass and w.slot == slot]


def _candidates(state: IterationState, kind: str, taken: set[int]) -> list[int]:
    """Live replicas not yet chosen whose death (alone) would be of `kind`; all of them for ANY."""
    blocked = taken | {s for r in taken for s in _shadows(state, r)}
    live = [r for r in state.live if r not in blocked]
    if kind == SPARE:
        return [r for r in live
                if state.work[r].base_role in SPARE_ROLES and not state.work[r].held]
    holders = [r for r in live if state.work[r].held]
    if kind == PROMOTION:
        return [r for r in holders if any(s not in blocked for s in _shadows(state, r))]
    if kind == BOUNDARY:
        return [r for r in holders if all(s in blocked for s in _shadows(state, r))]
    return live


def classify(state: IterationState, failed: list[int], decision: PolicyDecision) -> dict:
    """Each victim of one agreed record -> (its role before the record, the record's effect on
    it: BOUNDARY, PROMOTION or DROPPED)."""
    promoted = {dead for dead, _ in decision.promotions}
    return {r: (state.work[r].role,
                DROPPED if not state.work[r].held else PROMOTION if r in promoted else BOUNDARY)
            for r in failed}


def plan_failures(config: PolicyConfig, count: int, seed: int) -> tuple[list[PlannedFailure], int]:
    """A schedule of `count` deaths following EPISODES, and the iterations the run needs.

    Victims are drawn (seeded) among the replicas whose death has the episode's kind in the
    policy's layout at that point; when none is left (spares run out), among all live replicas.
    A death in recovery goes to the extension pass when the iteration has one, else to the
    blocking restore, so each entry names a point the run reaches.
    """
    if not 0 < count < config.w_init:
        raise ValueError(f"--failures must be in 1..{config.w_init - 1} (one replica survives)")
    rng = random.Random(seed)
    policy = WorkloadPolicy(config)
    planned: list[PlannedFailure] = []
    episodes = itertools.cycle(EPISODES)
    iteration = FIRST_FAILURE - FAILURE_SPACING
    while len(planned) < count:
        iteration += FAILURE_SPACING
        episode = next(episodes)[:count - len(planned)]
        while policy.last_committed < iteration - 1:
            policy.begin()
            policy.commit()
        policy.begin(iteration)
        first = [kind for kind, loc in episode if loc in FIRST_RECORD]
        planned += _record(policy, rng, iteration, iteration, first,
                           [loc for _, loc in episode if loc in FIRST_RECORD])
        for kind, _ in (e for e in episode if e[1] in IN_RECOVERY):
            location = "during-extension" if policy.state.round > 0 else "during-restore"
            planned += _record(policy, rng, iteration, iteration, [kind], [location])
        policy.commit()
        after = [e for e in episode if e[1] in AFTER_COMMIT]
        if after:
            policy.begin(iteration + 1)
            planned += _record(policy, rng, iteration, iteration + 1, [k for k, _ in after],
                               [loc for _, loc in after])
            policy.commit()  # the next iteration is quiet otherwise (FAILURE_SPACING)
    return planned, max(p.record_iteration for p in planned) + TRAILING_ITERATIONS


def _record(policy, rng, iteration, record_iteration, kinds, locations) -> list[PlannedFailure]:
    """Choose one victim per kind, apply them to the policy as one agreed record."""
    if not kinds:
        return []
    state, victims = policy.state, []
    for kind in kinds:
        pool = _candidates(state, kind, set(victims)) or _candidates(state, ANY, set(victims))
        victims.append(rng.choice(pool))
    effects = classify(state, victims, policy.on_failure(victims))
    return [PlannedFailure(ScheduleEntry(iteration, r, 0, loc), *effects[r], record_iteration)
            for r, loc in zip(victims, locations)]


def job_arguments(replicas: int, g_init: int, iterations: int) -> list[str]:
    """A very small GPT: the run measures recovery at scale, not compute. Dropout is on, so a
    recomputed microbatch must reproduce its id's dropout mask; four gradient buckets, so a death
    inside the reduce leaves some buckets reduced and others not."""
    return ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--eval-iters", "0",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--global-batch-size", str(g_init * replicas), "--train-iters", str(iterations),
            "--lr", "1e-2", "--clip-grad", "1.0", "--seed", "1234", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
            "--overlap-grad-reduce", "--ddp-bucket-size", "1000", "--log-interval", "1",
            "--recover"]


class RunWatcher:
    """While a run goes (the launcher calls `poll` every launch.POLL_S): print each new log
    record and note when the first one appears (a cheap stat per call), and every
    MEMORY_PERIOD_S sample the ranks' memory by the PIDs in their status files (PSS, so shared
    library pages count once; reading it walks each rank's page tables, so it is sampled seldom).
    """

    MEMORY_PERIOD_S = 3.0

    def __init__(self, log: Path, status_dir: Path, say):
        self.log, self.status_dir, self.say = log, status_dir, say
        self.start_time = time.time()
        self.first_record_time: float | None = None
        self.peak_pss_kib = 0
        self._seen = 0
        self._size = 0
        self._sampled = 0.0

    def poll(self) -> None:
        self._follow_log()
        if time.monotonic() - self._sampled >= self.MEMORY_PERIOD_S:
            self._sampled = time.monotonic()
            self._sample_memory()

    def stop(self) -> None:
        self._follow_log()

    def _follow_log(self) -> None:
        try:
            size = self.log.stat().st_size
        except FileNotFoundError:
            return
        if size == self._size:
            return
        self._size = size
        text = self.log.read_text()
        complete = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
        for line in complete[self._seen:]:
            if self.first_record_time is None:
                self.first_record_time = time.time()
            self.say(progress_line(json.loads(line)))
        self._seen = max(self._seen, len(complete))

    def _sample_memory(self) -> None:
        total = 0
        for path in self.status_dir.glob("rank-*.json"):
            try:
                pid = json.loads(path.read_text())["pid"]
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            except (OSError, ValueError, KeyError):
                pass  # not started, already gone, or its status file is being replaced
        self.peak_pss_kib = max(self.peak_pss_kib, total)


def progress_line(record: dict) -> str:
    line = (f"  iteration {record['iteration']:3d}: live {record['live_replicas']:2d}"
            f" loss {record['loss']:.6f} contributions {record['contributions']}/{record['B']}"
            f" invariant {'ok' if record['invariant_ok'] else 'VIOLATED'}"
            f" {record['iteration_ms']:8.1f} ms")
    for event in record["events"]:
        if event["event"] == "failure":
            line += (f" | lost {event['replicas']}, {event.get('restore')} restore"
                     f", g_ext {event.get('g_ext')}, promoted {event.get('promotions')}")
        else:
            line += f" | {event['event']}"
    return line


def run_job(name: str, out: Path, replicas: int, args: list[str], timeout_s: float,
            say) -> dict:
    """One launch under the timeout; returns its records, statuses and timings."""
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir / "log.jsonl"
    command = [sys.executable, str(ROOT / "pretrain_gpt_recover.py"), *args,
               "--recover-log", str(log)]
    say(f"=== {name}: {replicas} ranks, timeout {timeout_s:.0f} s")
    watcher = RunWatcher(log, run_dir / "status", say)
    result = launch(LaunchConfig(replicas, command, run_dir / "status", timeout_s),
                    poll=watcher.poll)
    watcher.stop()
    (run_dir / "output.txt").write_text(result.output)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    startup_s = None
    if records and watcher.first_record_time is not None:
        # Launch until rank 0 began iteration 1; what the other ranks still needed to start
        # lands in iteration 1's time (its reduce waits for them).
        startup_s = (watcher.first_record_time - watcher.start_time
                     - records[0]["iteration_ms"] / 1e3)
    say(f"=== {name}: {'succeeded' if result.succeeded else 'FAILED'}"
        f"{' (timed out)' if result.timed_out else ''} in {result.elapsed_s:.1f} s, "
        f"{len(records)} iterations logged, peak PSS {watcher.peak_pss_kib / 2**20:.2f} GiB")
    return {"records": records, "statuses": result.statuses, "succeeded": result.succeeded,
            "timed_out": result.timed_out, "wall_s": result.elapsed_s, "startup_s": startup_s,
            "first_iteration_s": records[0]["iteration_ms"] / 1e3 if records else None,
            "iterations_s": sum(r["iteration_ms"] for r in records) / 1e3,
            "peak_pss_gib": watcher.peak_pss_kib / 2**20, "dir": run_dir}


def replay(config: PolicyConfig, records: list[dict]) -> tuple[list[dict], list[str]]:
    """Drive the policy with the agreed failure records of a run's log, as every survivor did.

    Returns one entry per death (replica, iteration, role, effect and the event's timestamps) and
    the disagreements between the replay and what the run logged (g_ext, promotions, the
    committed count).
    """
    policy = WorkloadPolicy(config)
    deaths, disagreements = [], []
    for record in records:
        t = record["iteration"]
        policy.begin(t)
        for event in record["events"]:
            if event["event"] != "failure":
                continue
            state = policy.state
            decision = policy.on_failure(event["replicas"])
            logged = (event.get("g_ext"), event.get("promotions"))
            if logged != (decision.g_ext, [list(p) for p in decision.promotions]):
                disagreements.append(f"iteration {t}: logged g_ext/promotions {logged}, policy "
                                     f"{decision.g_ext}/{list(decision.promotions)}")
            for replica, (role, effect) in classify(state, event["replicas"], decision).items():
                deaths.append({"replica": replica, "record_iteration": t, "role": role,
                               "effect": effect, "event": event})
        result = policy.commit()
        if result.contributions != record["contributions"]:
            disagreements.append(f"iteration {t}: logged {record['contributions']} "
                                 f"contributions, policy {result.contributions}")
    return deaths, disagreements


def recovery_times(deaths: list[dict], markers: list[dict]) -> list[dict]:
    """Per death: seconds from the victim's marker (the kill) to each timestamp of its event."""
    killed_at = {m["rank"]: m for m in markers}  # one rank per replica: rank == replica
    rows = []
    for death in deaths:
        marker = killed_at.get(death["replica"])
        row = {k: death[k] for k in ("replica", "record_iteration", "role", "effect")}
        row["location"] = marker.get("location") if marker else None
        for stamp in ("detected", "repaired", "restored", "committed"):
            value = death["event"].get(stamp)
            row[f"{stamp}_s"] = (None if marker is None or value is None
                                 else round(value - marker["time"], 4))
        rows.append(row)
    return rows


def invariant_violations(records: list[dict], reference: list[dict]) -> list[str]:
    """Iterations whose gradient ledger broke the invariant or committed other batches than the
    reference (the ledger checksum sums the committed batches' checksums)."""
    problems = []
    ref_checksum = {r["iteration"]: r["ledger_checksum"] for r in reference}
    for r in records:
        t = r["iteration"]
        if r["contributions"] != r["B"]:
            problems.append(f"iteration {t}: {r['contributions']} contributions, B = {r['B']}")
        if not r["invariant_ok"]:
            problems.append(f"iteration {t}: ledger invariant violated: "
                            + "; ".join(r["ledger_problems"]))
        if r["ledger_checksum"] != ref_checksum.get(t):
            problems.append(f"iteration {t}: ledger checksum {r['ledger_checksum']} vs reference "
                            f"{ref_checksum.get(t)}")
    return problems


def loss_differences(records: list[dict], reference: list[dict]) -> tuple[float, float]:
    ref = {r["iteration"]: r["loss"] for r in reference}
    pairs = [(r["loss"], ref[r["iteration"]]) for r in records if r["iteration"] in ref]
    if not pairs:
        return float("nan"), float("nan")
    return (max(abs(a - b) for a, b in pairs), max(abs(a - b) / abs(b) for a, b in pairs))


def _stats(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "max": round(max(values), 4)}


TOLERANCE = 1e-5  # relative loss difference to the reference, as the end-to-end tests allow


def summarize(config: PolicyConfig, plan: list[PlannedFailure], iterations: int,
              runs: dict[str, dict], markers: list[dict]) -> dict:
    ref, run = runs["reference"], runs["failure"]
    entries = [p.entry for p in plan]
    report = injection_report(entries, markers_path(run["dir"]),
                              {(r, 0): r for r in range(config.w_init)})
    deaths, disagreements = replay(config, run["records"])
    rows = recovery_times(deaths, markers)
    injected = {m["rank"] for m in markers}
    complete = [r["iteration"] for r in run["records"]] == list(range(1, iterations + 1))
    survived = {d["replica"] for d in deaths} & injected if run["succeeded"] and complete else set()
    digests = {s.get("param_digest") for s in run["statuses"].values()
               if s.get("state") == "completed"}
    max_abs, max_rel = loss_differences(run["records"], ref["records"])
    violations = invariant_violations(run["records"], ref["records"])
    observed = sorted((d["replica"], d["record_iteration"], d["effect"]) for d in deaths)
    summary = {
        "replicas": config.w_init, "g_init": config.g_init, "B": config.b,
        "iterations": iterations,
        "failures_scheduled": len(entries),
        "failures_injected": len(report["injected"]),
        "failures_not_injected": report["not_injected"],
        "failures_survived": len(survived),
        "boundary_failures": sum(d["effect"] == BOUNDARY for d in deaths),
        "promotion_failures": sum(d["effect"] == PROMOTION for d in deaths),
        "spare_failures": sum(d["role"] in SPARE_ROLES for d in deaths),
        "locations": dict(sorted(Counter(m.get("location") for m in markers).items())),
        "plan_matches_run": observed == sorted((p.entry.replica, p.record_iteration, p.effect)
                                               for p in plan),
        "policy_replay_disagreements": disagreements,
        "invariant_violations": violations,
        "iterations_logged": {name: len(r["records"]) for name, r in runs.items()},
        "max_abs_loss_diff": max_abs,
        "max_rel_loss_diff": max_rel,
        "live_replicas_final": run["records"][-1]["live_replicas"] if run["records"] else None,
        "survivors_completed": sum(s.get("state") == "completed"
                                   for s in run["statuses"].values()),
        "survivors_agree_bitwise": len(digests) == 1 and None not in digests,
        "recovery_s": {stamp: _stats([row[f"{stamp}_s"] for row in rows])
                       for stamp in ("detected", "repaired", "restored", "committed")},
        "failures": rows,
        "runs": {name: {k: (round(r[k], 3) if isinstance(r[k], float) else r[k])
                        for k in ("succeeded", "timed_out", "wall_s", "startup_s",
                                  "first_iteration_s", "iterations_s", "peak_pss_gib")}
                 for name, r in runs.items()},
    }
    checks = {
        "both runs succeeded and logged every iteration": ref["succeeded"] and run["succeeded"]
        and complete,
        "every scheduled failure was injected and survived":
        summary["failures_injected"] == summary["failures_survived"] == len(entries),
        "a failure made a policy boundary": summary["boundary_failures"] >= 1,
        "a spare was killed": summary["spare_failures"] >= 1,
        "the invariant held in every iteration": not violations,
        "the policy replayed from the log agrees with the run": not disagreements,
        "the survivors' parameters are equal bitwise": summary["survivors_agree_bitwise"],
        f"the loss is within {TOLERANCE:g} (relative) of the reference": max_rel <= TOLERANCE,
    }
    summary["failed_checks"] = [name for name, passed in checks.items() if not passed]
    summary["ok"] = not summary["failed_checks"]
    return summary


def markers_path(run_dir: Path) -> Path:
    return run_dir / "log.markers.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true",
                        help="print the summary as JSON (progress goes to stderr)")
    parser.add_argument("--replicas", type=int, default=32, help="W_init, one rank each")
    parser.add_argument("--failures", type=int, default=None,
                        help="replicas killed across the run (default: half of them)")
    parser.add_argument("--g-init", type=int, default=2,
                        help="microbatches per replica at launch (B = replicas x G_init)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the victims' draw")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/scale")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="hard limit of each of the two runs, seconds")
    args = parser.parse_args()
    stream = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=stream, flush=True)

    try:
        config = PolicyConfig(args.replicas, args.g_init)
        failures = args.replicas // 2 if args.failures is None else args.failures
        plan, iterations = plan_failures(config, failures, args.seed)
    except ValueError as error:
        parser.error(str(error))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    schedule = out / "schedule.yaml"
    write_schedule([p.entry for p in plan], schedule)
    (out / "plan.json").write_text(json.dumps([asdict(p) for p in plan], indent=1) + "\n")
    say(f"plan: {args.replicas} replicas, B = {config.b}, {iterations} iterations, "
        f"{len(plan)} failures (schedule in {schedule}):")
    for p in plan:
        say(f"  iteration {p.entry.iteration:3d}: replica {p.entry.replica:2d} "
            f"{p.entry.location:16s} {p.role:14s} -> {p.effect}")

    started = time.monotonic()
    job = job_arguments(args.replicas, args.g_init, iterations)
    runs = {"reference": run_job("reference", out, args.replicas, job, args.timeout, say)}
    runs["failure"] = run_job("failure", out, args.replicas,
                              job + ["--recover-failure-schedule", str(schedule)],
                              args.timeout, say)
    summary = summarize(config, plan, iterations, runs, read_markers(
        markers_path(runs["failure"]["dir"])))
    summary["total_wall_s"] = round(time.monotonic() - started, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    if args.json:
        print(json.dumps(summary))
    else:
        print_report(summary)
    say(f"wrote {out / 'summary.json'}")
    return 0 if summary["ok"] else 1


def print_report(s: dict) -> None:
    print(f"\n=== {s['replicas']} replicas, B = {s['B']}, {s['iterations']} iterations")
    print("failure  iter  location          role            effect      detect   restore  commit"
          "  (s after the kill)")
    for row in s["failures"]:
        cells = [f"{row[k]:7.3f}" if row[k] is not None else "    n/a"
                 for k in ("detected_s", "restored_s", "committed_s")]
        print(f"  {row['replica']:5d}  {row['record_iteration']:4d}  {row['location'] or '?':16s}"
              f"  {row['role']:14s}  {row['effect']:10s}  {'  '.join(cells)}")
    print(f"failures: {s['failures_scheduled']} scheduled, {s['failures_injected']} injected, "
          f"{s['failures_survived']} survived; {s['boundary_failures']} made a policy boundary, "
          f"{s['promotion_failures']} were absorbed by a promotion, {s['spare_failures']} "
          f"killed a spare; the run went as planned: {s['plan_matches_run']}")
    print(f"ledger invariant (B gradients, the failure-free batches, == reference) in every "
          f"iteration: {not s['invariant_violations']}")
    for problem in s["invariant_violations"] + s["policy_replay_disagreements"]:
        print(f"  {problem}")
    print(f"max |loss - reference|: {s['max_abs_loss_diff']:.3e} (relative "
          f"{s['max_rel_loss_diff']:.3e}); {s['survivors_completed']} survivors, parameters "
          f"equal bitwise: {s['survivors_agree_bitwise']}")
    for name, run in s["runs"].items():
        startup = "n/a" if run["startup_s"] is None else f"{run['startup_s']:.1f} s"
        print(f"{name}: {'ok' if run['succeeded'] else 'FAILED'}"
              f"{' (timed out)' if run['timed_out'] else ''}, wall {run['wall_s']:.1f} s, "
              f"start-up {startup}, iterations {run['iterations_s']:.1f} s (the first "
              f"{run['first_iteration_s'] or 0:.1f} s), peak PSS {run['peak_pss_gib']:.2f} GiB")
    print(f"total wall time {s['total_wall_s']:.1f} s; verdict: {'ok' if s['ok'] else 'FAILED'}")
    for check in s["failed_checks"]:
        print(f"  not so: {check}")


if __name__ == "__main__":
    sys.exit(main())
