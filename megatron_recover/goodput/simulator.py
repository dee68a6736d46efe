"""A seeded, event-driven simulator of a long pre-training run under failures.

The model behind every figure of `megatron-recover goodput`:

- **The job.** `gpus` GPUs in replicas of `gpus_per_replica` (TP x PP x CP: a failure takes its
  whole replica down), each replica running G microbatches of `tokens_per_microbatch` tokens in
  a failure-free iteration of `iteration_s`; B = G x replicas.
- **Failures.** A Poisson process in wall-clock time over the training GPUs, at the job's mean
  time between failures for its size (`FailureModel`). A failure is a hang with probability
  `hang_share`: it is noticed after the system's hang timeout instead of at once. Every system
  replays the same trace.
- **Costs add up.** A failure that arrives while the job still pays for an earlier one costs
  its own full price after it: each interruption needs its own detection and repair. A system
  whose failures each stall it for s at mean spacing M therefore keeps 1 - s/M of its time,
  the accounting of the published figures (`anchors`).
- **The systems.**
  `checkpoint-restart`: a blocking checkpoint every `interval` iterations (Young/Daly for the
  job's MTBF unless given). A failure loses the work since the newest complete checkpoint and
  costs detection, restart initialization and the checkpoint load; the job restarts at full size
  (the scheduler swaps the failed node in during the restart).
  `in-memory-restart`: the same with in-memory checkpoints (their own save and load costs).
  `drop-and-go`: the failed replica leaves. Survivors keep their own share, so B shrinks; the
  failed replica's microbatches of the iteration are lost. A failure costs detection and repair.
  `recover`: the failed replica leaves. The survivors redo its microbatches in the same iteration
  (the extension pass) and take over its share of B, so their iterations get longer.
  `recover+standbys`: as recover, with K standby replicas allocated. After an iteration that
  lost replicas, standbys join (`join_s`, the layout grows back). A lost replica's hardware comes
  back as a standby `replace_s` after its failure.
  `recover+restarts`: as recover, restarted at full size on a fixed schedule when it was below
  full size at the scheduled time (checkpoint, restart initialization, load: the scheduler
  replaces the lost nodes), every `regrow_interval_s` (the period balancing that cost against
  the capacity lost meanwhile) unless given: what an operator without standbys does rather than
  shrink for the whole run. A planned restart is a reset, so one more failure can help it (it
  can move which later failures fall before a scheduled restart): adding a failure may raise
  its ETTR. For recover+standbys it may by up to one iteration's tokens (a join lands at the
  next iteration boundary, which the extra failure can move); for the others, never.
- **Allocation** (what ETTR divides by, `ettr.Allocation`). Restart holds R x g GPUs. Recover and
  drop-and-go hold the same for ever: a dead replica counts, since nothing replaces it.
  Recover+standbys holds (R + K) x g.
- **Not modelled.** Failures of idle standbys; a shrinking job's fallback when every replica is
  lost between two planned restarts (the run's progress ends there); stragglers; the
  cross-replica reduction's cost as the replica count changes.
"""

import math
import random
from collections import deque
from dataclasses import dataclass, field

from megatron_recover.goodput.ettr import Allocation, ettr
from megatron_recover.hang import DEFAULT_HANG_TIMEOUT_S

HOUR_S = 3600.0
DAY_S = 24 * HOUR_S

# Published mean times between job interruptions at scale; `FailureModel`'s default curve is the
# power law through them. (GPUs, MTBF seconds, source.)
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 466, 54, 16384
HSDP_MTBF_S, HSDP_GPUS = 18 * 60.0, 100_000
MTBF_POINTS = (
    (LLAMA3_GPUS, LLAMA3_DAYS * DAY_S / LLAMA3_INTERRUPTIONS,
     "Llama 3 (arXiv:2407.21783): 466 job interruptions in 54 days on 16,384 H100"),
    (HSDP_GPUS, HSDP_MTBF_S,
     "fault-tolerant HSDP on 100,000 GPUs (arXiv:2602.00277), as quoted by the ReCoVer paper: "
     "a failure every 18 minutes"),
)


def published_mtbf_s(gpus: int) -> float:
    """The job MTBF at `gpus` on the power law through MTBF_POINTS (interpolated between them,
    extrapolated outside)."""
    (n1, m1, _), (n2, m2, _) = MTBF_POINTS
    alpha = math.log(m1 / m2) / math.log(n2 / n1)
    return m1 * (n1 / gpus) ** alpha


@dataclass(frozen=True)
class FailureModel:
    """`gpu_mtbf_hours`: a constant per-GPU failure rate (one GPU's MTBF); None: the published
    curve. `job_mtbf_s`, when set, overrides both (a figure's own MTBF)."""

    gpu_mtbf_hours: float | None = None
    job_mtbf_s_override: float | None = None
    hang_share: float = 0.0

    def job_mtbf_s(self, gpus: int) -> float:
        if self.job_mtbf_s_override is not None:
            return self.job_mtbf_s_override
        if self.gpu_mtbf_hours is not None:
            return self.gpu_mtbf_hours * HOUR_S / gpus
        return published_mtbf_s(gpus)

    def describe(self) -> str:
        if self.job_mtbf_s_override is not None:
            return f"job MTBF {self.job_mtbf_s_override / 60:.1f} min"
        if self.gpu_mtbf_hours is not None:
            return f"per-GPU MTBF {self.gpu_mtbf_hours:g} h"
        return "MTBF against scale through " + "; ".join(p[2] for p in MTBF_POINTS)


@dataclass(frozen=True)
class Costs:
    """Per-event costs in seconds (the defaults are this project's assumptions, stated in
    docs/goodput.md; `--from-log` replaces recover's with measured ones)."""

    detection_s: float = 30.0            # a crash noticed by a stock job (collective error)
    hang_timeout_s: float = 600.0        # a stock job's hang: torch's default NCCL timeout
    restart_init_s: float = 240.0        # reallocation, process start, communicators, model
    checkpoint_save_s: float = 10.0      # the blocking part of an (asynchronous) save
    checkpoint_load_s: float = 60.0
    memory_save_s: float = 1.0           # in-memory checkpoints
    memory_load_s: float = 10.0
    recover_detection_s: float = 1.0     # ULFM's failure notice
    recover_hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S  # --recover-hang-timeout's default
    recover_repair_s: float = 1.0        # revoke, shrink, agree
    recover_restore_s: float | None = None  # measured detection-to-restored time (from a log)
    join_s: float = 30.0                 # a standby receives the state and joins
    replace_s: float = 1800.0            # a lost replica's hardware back as a standby


@dataclass(frozen=True)
class Job:
    """Weak scaling, as pre-training grows: each replica keeps its G microbatches per iteration,
    so B = G x replicas and the iteration time stays `iteration_s` at every size."""

    gpus: int
    gpus_per_replica: int = 128          # Llama 3 405B: TP 8 x PP 16
    iteration_s: float = 6.0
    microbatches_per_replica: int = 16   # Llama 3 405B at 16k GPUs: 2,048 sequences over DP 128
    tokens_per_microbatch: int = 8192

    def __post_init__(self):
        if self.gpus < self.gpus_per_replica:
            raise ValueError(f"{self.gpus} GPUs hold no replica of {self.gpus_per_replica}")
        if self.microbatches_per_replica < 1:
            raise ValueError("every replica needs at least one microbatch")
        if self.iteration_s <= 0:
            raise ValueError("iteration_s must be positive")

    @property
    def replicas(self) -> int:
        return self.gpus // self.gpus_per_replica

    @property
    def microbatches(self) -> int:
        return self.microbatches_per_replica * self.replicas

    @property
    def tokens_per_iteration(self) -> int:
        return self.microbatches * self.tokens_per_microbatch

    @property
    def training_gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    @property
    def failure_free_tokens_per_gpu_s(self) -> float:
        return self.tokens_per_iteration / (self.iteration_s * self.training_gpus)


@dataclass(frozen=True)
class Failure:
    time_s: float
    hang: bool = False


def failure_trace(mtbf_s: float, hang_share: float, horizon_s: float,
                  seed: int) -> tuple[Failure, ...]:
    """Poisson arrivals at mean spacing `mtbf_s` over [0, horizon_s)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return tuple(out)
        out.append(Failure(t, rng.random() < hang_share))


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum checkpoint interval (compute time between saves)."""
    if save_s <= 0:
        return 0.0
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


SYSTEMS = ("checkpoint-restart", "in-memory-restart", "drop-and-go", "recover",
           "recover+restarts", "recover+standbys")
KEEPS = {  # (keeps B, keeps the failure-free trajectory)
    "checkpoint-restart": (True, True), "in-memory-restart": (True, True),
    "drop-and-go": (False, False), "recover": (True, True), "recover+restarts": (True, True),
    "recover+standbys": (True, True),
}


@dataclass
class RunResult:
    system: str
    committed_tokens: float
    allocation: Allocation
    failures: int                  # failures that struck the job
    live_replicas: list[tuple[float, int]] = field(default_factory=list)  # (time, live)
    interval: int | None = None    # checkpoint interval, iterations
    standbys: int = 0

    def ettr(self, job: Job) -> float:
        return ettr(self.committed_tokens, self.allocation, job.failure_free_tokens_per_gpu_s)

    def tokens_per_s(self) -> float:
        return self.committed_tokens / (self.allocation.end_s - self.allocation.start_s)


def checkpoint_interval(job: Job, save_s: float, mtbf_s: float) -> int:
    """Young/Daly's interval in whole iterations (at least one)."""
    return max(1, round(young_daly_interval_s(save_s, mtbf_s) / job.iteration_s))


def simulate_restart(job: Job, trace: tuple[Failure, ...], horizon_s: float, *,
                     interval: int, save_s: float, failure_cost_s, name: str) -> RunResult:
    """Checkpoint every `interval` iterations (blocking `save_s`); a failure rolls back to the
    newest complete checkpoint and stalls the job for `failure_cost_s(failure)`."""
    t, committed, checkpoint, i, struck = 0.0, 0, 0, 0, 0
    live = [(0.0, job.replicas)]
    while t < horizon_s:
        next_failure = trace[i].time_s if i < len(trace) else math.inf
        stop = min(next_failure, horizon_s)
        since = committed - checkpoint
        if since == interval:  # a save is due
            if t + save_s <= stop:
                t += save_s
                checkpoint = committed
                continue
        else:
            k = min(interval - since, math.floor((stop - t) / job.iteration_s))
            if k > 0:
                t += k * job.iteration_s
                committed += k
                continue
        if stop == horizon_s:
            break
        # The failure strikes inside the next iteration or save.
        down_until = next_failure + failure_cost_s(trace[i])
        i += 1
        struck += 1
        while i < len(trace) and trace[i].time_s < down_until:  # costs add up
            down_until += failure_cost_s(trace[i])
            i += 1
            struck += 1
        live += [(next_failure, 0), (min(down_until, horizon_s), job.replicas)]
        committed = checkpoint
        t = down_until
    tokens = committed * job.tokens_per_iteration
    allocation = Allocation.constant(job.training_gpus, 0.0, horizon_s)
    return RunResult(name, tokens, allocation, struck, live, interval)


def planned_restart_s(costs: Costs) -> float:
    """A planned restart at full size: checkpoint, restart initialization, load."""
    return costs.checkpoint_save_s + costs.restart_init_s + costs.checkpoint_load_s


def regrow_interval_s(job: Job, mtbf_s: float, costs: Costs) -> float:
    """When to restart a shrinking job at full size: each failure costs 1/R of the throughput
    until then, a restart costs C, so the period P minimizing C / P + P / (2 R MTBF) is
    sqrt(2 C R MTBF) (Young's form)."""
    return math.sqrt(2 * planned_restart_s(costs) * job.replicas * mtbf_s)


def simulate_replicas(job: Job, trace: tuple[Failure, ...], horizon_s: float, costs: Costs, *,
                      keep_batch: bool, standbys: int, name: str,
                      regrow_s: float = 0.0) -> RunResult:
    """Failed replicas leave. keep_batch: recover (survivors redo the lost microbatches and take
    over the share); otherwise drop-and-go. `standbys` replicas join after failures. Every
    `regrow_s` of wall-clock time (0: never), a job below full size restarts at full size
    (`planned_restart_s`: the scheduler replaces the lost nodes)."""
    r0, b = job.replicas, job.microbatches
    microbatch_s = job.iteration_s / job.microbatches_per_replica  # one on one replica
    live_now, pool, returning = r0, standbys, deque()
    t, tokens, i, struck = 0.0, 0.0, 0, 0
    next_regrow = regrow_s or math.inf
    live = [(0.0, r0)]
    while t < horizon_s and live_now > 0:
        while returning and returning[0] <= t:
            returning.popleft()
            pool = min(standbys, pool + 1)
        if t >= next_regrow:  # the planned restarts keep a fixed wall-clock schedule
            due = next_regrow
            next_regrow += regrow_s * math.floor((t - next_regrow) / regrow_s + 1)
            # Decided by the size at the scheduled time, carried out at this boundary.
            if next(n for when, n in reversed(live) if when <= due) < r0:
                t += planned_restart_s(costs)
                live_now = r0
                live.append((t, live_now))
                continue
        if pool and live_now < r0:  # standbys join at this iteration boundary
            joined = min(pool, r0 - live_now)
            pool -= joined
            t += costs.join_s
            live_now += joined
            live.append((t, live_now))
            continue
        share = math.ceil(b / live_now) if keep_batch else b / r0
        iteration_s = share * microbatch_s
        next_failure = trace[i].time_s if i < len(trace) else math.inf
        k = math.floor((min(next_failure, horizon_s) - t) / iteration_s)
        for wake in ((returning[0] if returning else math.inf), next_regrow):
            if live_now < r0 and wake < math.inf:  # stop at the first boundary after it
                k = min(k, max(1, math.ceil((wake - t) / iteration_s)))
        if k > 0:
            t += k * iteration_s
            iteration_tokens = job.tokens_per_iteration * (1 if keep_batch else
                                                           live_now * share / b)
            tokens += k * iteration_tokens
            continue
        # One iteration with failures in it (or cut by the horizon).
        end, started_with, lost = t + iteration_s, live_now, 0.0
        while i < len(trace) and trace[i].time_s < end and live_now > 0:
            failure = trace[i]
            i += 1
            struck += 1
            live_now -= 1
            live.append((max(failure.time_s, t), live_now))  # one during a join: after it
            if standbys:
                returning.append(failure.time_s + costs.replace_s)
            if live_now == 0:
                break
            detect = costs.recover_hang_timeout_s if failure.hang else costs.recover_detection_s
            if keep_batch:
                if costs.recover_restore_s is not None:
                    end += detect + costs.recover_restore_s
                else:  # the survivors redo the dead replica's microbatches
                    end += detect + costs.recover_repair_s + math.ceil(
                        share / live_now) * microbatch_s
            else:
                end += detect + costs.recover_repair_s
                lost += share
        if live_now == 0 or end > horizon_s:
            break
        t = end
        tokens += job.tokens_per_iteration * (1 if keep_batch else
                                              (started_with * share - lost) / b)
    allocation = Allocation.constant((r0 + standbys) * job.gpus_per_replica, 0.0, horizon_s)
    return RunResult(name, tokens, allocation, struck, live, standbys=standbys)


def default_standbys(job: Job, mtbf_s: float, costs: Costs) -> int:
    """Enough standbys for the replacements in flight: twice the failures expected while one
    is being replaced."""
    return max(1, math.ceil(2 * costs.replace_s / mtbf_s))


def simulate(job: Job, model: FailureModel, costs: Costs, horizon_s: float, seed: int,
             systems=SYSTEMS, standbys: int | None = None, interval: int | None = None,
             trace: tuple[Failure, ...] | None = None,
             regrow_s: float | None = None) -> dict[str, RunResult]:
    """Every system against one failure trace (drawn from `seed` unless given). `regrow_s`:
    recover+restarts' period (None: `regrow_interval_s`)."""
    mtbf_s = model.job_mtbf_s(job.training_gpus)
    if trace is None:
        trace = failure_trace(mtbf_s, model.hang_share, horizon_s, seed)

    def stock_cost(load_s):
        return lambda f: ((costs.hang_timeout_s if f.hang else costs.detection_s)
                          + costs.restart_init_s + load_s)

    k = default_standbys(job, mtbf_s, costs) if standbys is None else standbys
    regrow = regrow_interval_s(job, mtbf_s, costs) if regrow_s is None else regrow_s
    restarts = {"checkpoint-restart": (costs.checkpoint_save_s, costs.checkpoint_load_s),
                "in-memory-restart": (costs.memory_save_s, costs.memory_load_s)}
    # (keeps B, standbys, planned restarts)
    replicas = {"drop-and-go": (False, 0, 0.0), "recover": (True, 0, 0.0),
                "recover+restarts": (True, 0, regrow), "recover+standbys": (True, k, 0.0)}
    out = {}
    for system in systems:
        if system in restarts:
            save_s, load_s = restarts[system]
            n = interval or checkpoint_interval(job, save_s, mtbf_s)
            out[system] = simulate_restart(job, trace, horizon_s, interval=n, save_s=save_s,
                                           failure_cost_s=stock_cost(load_s), name=system)
        elif system in replicas:
            keep_batch, pool, every = replicas[system]
            out[system] = simulate_replicas(job, trace, horizon_s, costs, keep_batch=keep_batch,
                                            standbys=pool, name=system, regrow_s=every)
        else:
            raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    return out


def sampled_live(result: RunResult, points: int = 15) -> list[tuple[float, int]]:
    """(hours, live replicas) at `points` evenly spaced times of the run (the first seed)."""
    end = result.allocation.end_s
    out = []
    for k in range(points):
        when = end * k / (points - 1)
        live = next(n for t, n in reversed(result.live_replicas) if t <= when)
        out.append((round(when / HOUR_S, 2), live))
    return out


def summarize(job: Job, results: list[dict[str, RunResult]]) -> dict[str, dict]:
    """Mean over seeds, per system: ETTR, committed tokens/s, live replicas at the end."""
    out = {}
    for system in results[0]:
        runs = [r[system] for r in results]
        keeps_batch, keeps_trajectory = KEEPS[system]
        out[system] = {
            "ettr": round(sum(r.ettr(job) for r in runs) / len(runs), 4),
            "tokens_per_s": round(sum(r.tokens_per_s() for r in runs) / len(runs), 1),
            "failures": round(sum(r.failures for r in runs) / len(runs), 1),
            "live_replicas_final": round(sum(r.live_replicas[-1][1] for r in runs)
                                         / len(runs), 1),
            "live_replicas_over_time": sampled_live(runs[0]),
            "replicas": job.replicas,
            "keeps_global_batch": keeps_batch, "keeps_trajectory": keeps_trajectory}
        if runs[0].interval is not None:
            out[system]["checkpoint_interval_iterations"] = runs[0].interval
        if runs[0].standbys:
            out[system]["standbys"] = runs[0].standbys
    return out
