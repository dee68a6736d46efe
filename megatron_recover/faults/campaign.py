"""A randomized fault campaign: seeded failure schedules against each configuration's failure-free
reference (`make fault-campaign N=... SEED=...`; a bounded slice runs in `make test`).

Case k of seed S is drawn from `random.Random(f"{S}:{k}")` alone, so `--seed S --case k` reruns
exactly that schedule (the instant a kill lands inside a collective is not reproducible). A case
draws one configuration of CATALOGUE (4-8 replicas; 1 or 2 ranks per replica through TP, PP or
distributed-optimizer shards; static exact, static reserve, adaptive) and 1-4 failures, at least
one replica surviving: single failures anywhere an iteration goes (including the optimizer
step's own collectives), and pairs in one iteration whose second failure lands in the recovery
of the first (extension pass, restore, consensus).

A case passes when the run ends (bounded), every failure that must be reached fired (its victim's
marker; a second failure of a pair at `during-extension` or `during-restore` is reached only if
the first one led there, and is otherwise reported as not injected), every iteration commits
exactly once, the ledger invariant held in every iteration (static: B contributions), completed
ranks that hold the same position agree bitwise and, in exact mode, every iteration's loss is
within 1e-6 relative and every completed rank's final parameters within 1e-6 (testing/compare.py)
of the reference. The model and learning rate are the tests' (STABLE_LR), where the failure-free
dynamics are not chaotic; a negative control (`--recover-no-restore`, one lost microbatch
gradient) shows the tolerance still catches a wrong gradient.
"""

import json
import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_recover.faults.injection import read_markers
from megatron_recover.faults.schedule import ScheduleEntry, write_schedule
from megatron_recover.launch import LaunchConfig, launch
from megatron_recover.testing.compare import EXACT_RTOL, STABLE_LR, loss_rdiff, param_rdiff

ITERATIONS = 6
MICROBATCHES_PER_REPLICA = 2
RUN_TIMEOUT_S = 300
# What rank 0 prints at start-up when the torch data plane carries the cross-replica bytes.
PLANE_LINE = "cross-replica data plane: torch"
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--eval-iters", "0",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--train-iters", str(ITERATIONS), *STABLE_LR, "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--overlap-grad-reduce",
         "--ddp-bucket-size", "2000", "--log-interval", "1", "--hidden-dropout", "0.1",
         "--attention-dropout", "0.1"]
LAYOUT_ARGS = {"dp": [], "tp2": ["--tensor-model-parallel-size", "2"],
               "pp2": ["--pipeline-model-parallel-size", "2"],
               "do2": ["--use-distributed-optimizer", "--num-distributed-optimizer-instances"]}
# Where a lone failure can land; the recovery locations only in a pair (they need a failure
# earlier in the same iteration to be reached).
SINGLE = ("pre-forward", "backward", "before-reduce", "during-reduce", "during-consensus",
          "optimizer-step", "grad-norm")
FIRST_OF_PAIR = ("backward", "before-reduce", "during-reduce", "during-consensus")
SECOND_OF_PAIR = ("during-extension", "during-restore", "during-consensus", "during-reduce",
                  "backward")
# Reached only when an earlier failure of the iteration led there.
CONDITIONAL = ("during-extension", "during-restore")


@dataclass(frozen=True)
class Config:
    replicas: int
    layout: str  # dp, tp2, pp2 or do2 (2 distributed-optimizer shards per replica)
    policy: str = "static"
    mode: str = "exact"

    @property
    def ranks_per_replica(self) -> int:
        return 1 if self.layout == "dp" else 2

    @property
    def ranks(self) -> int:
        return self.replicas * self.ranks_per_replica

    @property
    def b(self) -> int:
        return self.replicas * MICROBATCHES_PER_REPLICA

    @property
    def name(self) -> str:
        return f"{self.replicas}x{self.ranks_per_replica}-{self.layout}-{self.policy}-{self.mode}"

    @property
    def exact(self) -> bool:
        return self.policy == "static" and self.mode == "exact"

    def args(self) -> list[str]:
        layout = LAYOUT_ARGS[self.layout] + ([str(self.replicas)] if self.layout == "do2" else [])
        return [*MODEL, "--global-batch-size", str(self.b), *layout, "--recover",
                "--recover-policy", self.policy, "--recover-mode", self.mode]

    def locations(self) -> tuple[str, ...]:
        return SINGLE + (("param-gather",) if self.layout == "do2" else ())


CATALOGUE = (
    Config(4, "dp"), Config(6, "dp"), Config(8, "dp"), Config(5, "dp", mode="reserve"),
    Config(6, "dp", policy="adaptive"), Config(4, "tp2"), Config(4, "pp2"), Config(4, "do2"),
    Config(4, "tp2", mode="reserve"), Config(4, "do2", policy="adaptive"),
)


@dataclass
class Case:
    seed: int
    index: int
    config: Config
    entries: list[ScheduleEntry]

    def describe(self) -> str:
        kills = ", ".join(f"it{e.iteration} r{e.replica}/{e.local_rank} {e.location}"
                          for e in self.entries)
        return (f"case {self.index} (--seed {self.seed} --case {self.index}) {self.config.name}: "
                f"{kills}")


def draw_case(seed: int, index: int, catalogue=CATALOGUE) -> Case:
    """Case `index` of `seed`: a configuration and 1-4 failures, at least one replica left."""
    rng = random.Random(f"{seed}:{index}")
    config = rng.choice(catalogue)
    count = rng.randint(1, min(4, config.replicas - 1))
    victims = rng.sample(range(config.replicas), count)
    entries = []
    while victims:
        replica = victims.pop()
        iteration = rng.randint(2, ITERATIONS - 1)
        if victims and rng.random() < 0.4:
            # Two in one iteration: the second lands in the first one's recovery.
            local_rank = rng.randrange(config.ranks_per_replica)
            entries.append(ScheduleEntry(iteration, replica, local_rank,
                                         rng.choice(FIRST_OF_PAIR)))
            replica = victims.pop()
            location = rng.choice(SECOND_OF_PAIR)
        else:
            location = rng.choice(config.locations())
        entries.append(ScheduleEntry(iteration, replica, rng.randrange(config.ranks_per_replica),
                                     location))
    return Case(seed, index, config, sorted(entries, key=lambda e: (e.iteration, e.replica)))


@dataclass
class Outcome:
    """What one case did and whether it passed (`problems` empty)."""

    case: str
    config: str
    drawn: int
    injected: int
    loss_rdiff: float | None = None
    param_rdiff: float | None = None
    ledger_violations: int = 0
    scenarios: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class Run:
    ok: bool
    output: str
    records: list[dict]
    markers: list[dict]
    statuses: dict
    status_dir: Path


def run_job(run_dir: Path, config: Config, extra: list[str] = (),
            entries: list[ScheduleEntry] | None = None, plane: str | None = None) -> Run:
    """pretrain_gpt_recover.py of `config` (and a schedule), bounded, in a fresh `run_dir`;
    `plane`: its --recover-data-plane (None: the default)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir / "log.jsonl"
    planes = ["--recover-data-plane", plane] if plane else []
    args = [*config.args(), *planes, *extra, "--recover-log", str(log)]
    if entries:
        write_schedule(entries, run_dir / "schedule.yaml")
        args += ["--recover-failure-schedule", str(run_dir / "schedule.yaml")]
    entry = Path(__file__).resolve().parents[2] / "pretrain_gpt_recover.py"
    result = launch(LaunchConfig(config.ranks, [sys.executable, str(entry), *args],
                                 run_dir / "status", RUN_TIMEOUT_S))
    (run_dir / "output.txt").write_text(result.output)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return Run(not result.timed_out and result.succeeded, result.output, records,
               read_markers(log.with_suffix(".markers.jsonl")), result.statuses,
               run_dir / "status")


def _params(run: Run, rank: int):
    import torch

    return torch.load(run.status_dir / f"rank-{rank}.params.pt")


def scenarios(case: Case, run: Run) -> list[str]:
    """The recovery paths a case reached, from the victims' markers and the run's log."""
    found = {m["location"] for m in run.markers
             if m.get("location") in ("optimizer-step", "grad-norm", "param-gather")}
    fired = Counter(m.get("iteration") for m in run.markers)
    if any(n > 1 for n in fired.values()):
        found.add("two in one iteration")
    fired_at = {(m.get("iteration"), m.get("location")) for m in run.markers}
    if any(e.replica == 0 and (e.iteration, e.location) in fired_at for e in case.entries):
        found.add("replica 0")
    if any(r["extension_rounds"] for r in run.records):
        found.add("extension pass")
    for record in run.records:
        for event in record["events"]:
            if event["event"] == "failure" and event["promotions"]:
                found.add("spare promoted")
            if event["event"] == "failure" and event["restore"] == "blocking":
                found.add("blocking restore")
    return sorted(found)


def judge(case: Case, run: Run, reference: Run) -> Outcome:
    """Check one case's run against its configuration's reference."""
    config = case.config
    outcome = Outcome(case.describe(), config.name, len(case.entries), len(run.markers))
    fired = Counter((m.get("iteration"), m.get("location")) for m in run.markers)
    required = Counter((e.iteration, e.location) for e in case.entries
                       if e.location not in CONDITIONAL)
    if required - fired:
        outcome.problems.append(f"failures that did not fire: {sorted(required - fired)}")
    if not run.ok:
        outcome.problems.append("the run did not succeed (see its output.txt)")
        return outcome
    iterations = [r["iteration"] for r in run.records]
    if iterations != list(range(1, ITERATIONS + 1)):
        outcome.problems.append(f"committed iterations {iterations}")
        return outcome
    bad = [r["iteration"] for r in run.records if not r["invariant_ok"]
           or (config.policy == "static" and r["contributions"] != config.b)]
    outcome.ledger_violations = len(bad)
    if bad:
        outcome.problems.append(f"ledger invariant violated in iterations {bad}")
    outcome.scenarios = scenarios(case, run)
    completed = sorted(r for r, s in run.statuses.items() if s.get("state") == "completed")
    # Ranks at one position hold bitwise-equal parameters in the reference; so must survivors.
    by_position = {}
    for rank in completed:
        by_position.setdefault(reference.statuses[rank]["param_digest"], set()).add(
            run.statuses[rank]["param_digest"])
    if any(len(digests) > 1 for digests in by_position.values()):
        outcome.problems.append("survivors at one position disagree bitwise")
    if config.exact:
        outcome.loss_rdiff = loss_rdiff(run.records, reference.records)
        outcome.param_rdiff = max(param_rdiff(_params(run, r), _params(reference, r))
                                  for r in completed)
        if outcome.loss_rdiff > EXACT_RTOL or outcome.param_rdiff > EXACT_RTOL:
            outcome.problems.append(f"not exact: loss {outcome.loss_rdiff:.2e}, parameters "
                                    f"{outcome.param_rdiff:.2e}")
    return outcome


def negative_control(out: Path, references: dict, plane: str | None = None) -> float:
    """One lost microbatch gradient (--recover-no-restore after a kill inside a reduce): the
    relative loss difference the exactness check must see."""
    config = CATALOGUE[0]
    reference = _reference(out, config, references, plane)
    entries = [ScheduleEntry(2, 1, 0, "during-reduce")]
    run = run_job(out / "negative-control", config, ["--recover-no-restore"], entries, plane)
    if not run.ok or len(run.records) != ITERATIONS:
        return float("nan")
    return loss_rdiff(run.records, reference.records)


def _reference(out: Path, config: Config, references: dict, plane: str | None = None) -> Run:
    if config.name not in references:
        run = run_job(out / "references" / config.name, config, plane=plane)
        if not run.ok:
            raise RuntimeError(f"the failure-free reference {config.name} failed:\n"
                               f"{run.output[-3000:]}")
        references[config.name] = run
    return references[config.name]


def run_campaign(cases: int, seed: int, out: Path, only: int | None = None,
                 catalogue=CATALOGUE, log=print, first: int = 0, plane: str | None = None,
                 control: bool = True, references: dict | None = None) -> dict:
    """Run cases `first`..`cases`-1 of `seed` (or only case `only`) under `out`, every run on
    data plane `plane` (None: the default), then the negative control unless `control` is
    False; returns the summary. Case k is the same whatever else runs and on either plane, so a
    long campaign may run in parts. `references` (configuration name -> failure-free run) is
    filled as references run; passing one campaign's to another judges the second against the
    first's failure-free runs (on another plane: the planes agree)."""
    start = time.monotonic()
    references = {} if references is None else references
    outcomes = []
    for index in ([only] if only is not None else range(first, cases)):
        case = draw_case(seed, index, catalogue)
        reference = _reference(out, case.config, references, plane)
        run = run_job(out / f"case-{index:03d}", case.config, entries=case.entries, plane=plane)
        outcome = judge(case, run, reference)
        if (plane == "torch") != (PLANE_LINE in run.output):  # the plane asked for ran
            outcome.problems.append(f"its data plane is not {plane}")
        outcomes.append(outcome)
        diffs = ("" if outcome.loss_rdiff is None else
                 f" loss {outcome.loss_rdiff:.1e}, parameters {outcome.param_rdiff:.1e};")
        verdict = "ok" if not outcome.problems else "FAILED: " + "; ".join(outcome.problems)
        log(f"{outcome.case} -> {outcome.injected}/{outcome.drawn} injected;{diffs} "
            f"{', '.join(outcome.scenarios) or '-'}; {verdict}")
    control = negative_control(out, references, plane) if control else None
    if control is not None:
        log(f"negative control (--recover-no-restore, one lost microbatch): loss {control:.2e}")
    exact = [o for o in outcomes if o.loss_rdiff is not None]
    scenarios = {}
    for outcome in outcomes:
        for name in outcome.scenarios:
            scenarios[name] = scenarios.get(name, 0) + 1
    summary = {
        "cases": len(outcomes),
        "cases_passed": sum(not o.problems for o in outcomes),
        "failures_injected": sum(o.injected for o in outcomes),
        "failures_survived": sum(o.injected for o in outcomes if not o.problems),
        "max_rel_loss_diff": max((o.loss_rdiff for o in exact), default=None),
        "max_rel_param_diff": max((o.param_rdiff for o in exact), default=None),
        "ledger_violations": sum(o.ledger_violations for o in outcomes),
        "negative_control_rel_loss_diff": control,
        "configurations": sorted({o.config for o in outcomes}),
        "scenarios": scenarios,
        "failed_cases": [o.case for o in outcomes if o.problems],
        "seed": seed,
        "data_plane": plane or "default",
        "wall_s": round(time.monotonic() - start, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "cases.jsonl").write_text("".join(json.dumps(asdict(o)) + "\n" for o in outcomes))
    return summary
