"""Failure schedules for training runs: which rank of which replica dies where, and when.

A schedule is YAML with a top-level `entries` list of {iteration, replica, local_rank, location},
optionally with `action`: `kill` (default: SIGKILL, a crash), `stop` (SIGSTOP: a frozen process,
which the hang detector must turn into a failure), `stall` (compute for `seconds` without any
communication: a healthy slow rank that must not be declared failed), `raise` (a Python error
of the program, `InjectedError`, which must end the job: docs/failures.md) or `device-error`
(a device fault raised into Python, `failures.DeviceFault`, which the survivors must absorb)
or `nan` (at `backward` only: the gradient of the victim's first microbatch of the iteration
becomes NaN while its loss stays right, as a faulty device's backward would make it, which
Megatron's check_for_nan_in_loss_and_grad must catch before the bucket leaves the replica)
or `bitflip` (at `before-reduce` only: one bit of one element of the victim's first gradient
bucket is flipped, after its first pass's backward and before anything of it is reduced or
fingerprinted: silent corruption, finite, which only sampled verification can catch; `bit`
names the bit, by default the fourth exponent bit of the bucket's type, scaling the element by
2^16 up or down)
or `slow` (at `pre-forward` only: from `iteration` on, through `until` if given, every pass the
victim runs takes `factor` times as long, or `seconds` longer per microbatch: a straggler, a
thermally throttled GPU or a degraded link, not a failure; the victim sleeps after each pass,
off the CPU, and writes a marker when the slowdown starts);
`raise` and `device-error` happen on the main thread, so not at the native points.
Locations, in the order an iteration reaches them:
  pre-forward       before the first forward of the iteration
  backward          after the first microbatch's forward, before its backward finishes
  before-reduce     before the first bucket reduction of a pass is posted (with
                    --overlap-grad-reduce, from the first pass's backward)
  after-post        right after the first ulfm all-reduce of a pass was posted (with
                    --overlap-grad-reduce, inside the first pass's backward)
  during-reduce     inside the ulfm all-reduce of a bucket, after it was posted (the second
                    bucket posted; with --overlap-grad-reduce the first, during backward; an
                    optional `bucket: N` names the N-th, from 1, of the iteration)
  during-consensus  inside the commit consensus, after the agreement was posted
  during-restore    after a failure, while stale buckets are rewound and reduced again
  during-extension  inside an extension pass, before its first backward
  optimizer-step    after the commit, before the optimizer step
  grad-norm         in the optimizer step, entering the gradient-norm all-reduce (megatron's
                    clip_grad_norm/get_grad_norm, run with --clip-grad > 0, on the replica's
                    model-parallel group: its peers wait inside it); needs --clip-grad > 0
  param-gather      in the distributed optimizer's step, entering the parameter all-gather of
                    the replica's shards (its first bucket group's; its peers wait inside it); needs
                    --use-distributed-optimizer
  evaluation        in the evaluation that follows the iteration (every --eval-interval, and at
                    the end), before the victim's first forward-only pass; needs an evaluation
                    after that iteration
  join-transfer     after the iteration, entering the broadcast of the training state to
                    standbys that join (the lowest survivor is the donor; any survivor takes
                    part); needs --recover-standby-replicas and a join after that iteration
  checkpoint-save   in the --save of that iteration, on a rank of the writing replica (the
                    lowest live one), after its part of the checkpoint is on disk and before the
                    tracker names it; needs a save after that iteration
With standby replicas a replica id comes back (a standby takes it), so it may be named again at a
later iteration: that entry is for the rank holding the id then.

An optional top-level `standbys` list of {standby, location} kills standby replica `standby`
(0-based, in rank order; its local rank 0): at `idle`, as soon as it starts waiting, or at
`join-transfer`, entering the state broadcast of the first join that calls it.
The victim writes a marker {location, iteration, rank, time} right before it SIGKILLs itself; an
entry whose point the run never reaches is reported as not injected (`injection_report`). A
victim inside a ulfm operation dies on the group's worker thread; its marker also says what the
main thread was doing then: "phase" is "schedule" while megatron's forward/backward runs (with
--overlap-grad-reduce a bucket's reduction can be in flight then), "after-schedule" otherwise.

An optional top-level `overflows` list of {iteration, microbatch_id} forces an fp16 overflow: the
backward of that microbatch, on whichever replica runs it (again, after a failure), is scaled to
inf, so the loss scaler must skip the step. Each firing leaves a marker with location `overflow`.
A schedule may hold only overflows (`entries: []`): the failure-free reference of such a run.

An optional top-level `bad_samples` list of {iteration, microbatch_id} makes that microbatch's
loss NaN on whichever replica runs it (again after a failure), as a sample that drives the
model to NaN does: Megatron's check must end the job there. Each firing leaves a marker with
location `bad-sample`.

An optional top-level `slow_snapshot_writes` list of {iteration, seconds} makes every rank's
snapshot writer (--recover-snapshot-interval) of that iteration pause for `seconds` halfway
through its file, as the write of a large model takes that long: a node lost meanwhile tears
the snapshot on every node. Each pause leaves a marker with location `snapshot-write`.
"""

import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from megatron_recover.errors import DeviceFault
from megatron_recover.faults.injection import read_markers, write_marker

LOCATIONS = ("pre-forward", "backward", "before-reduce", "after-post", "during-reduce",
             "during-consensus",
             "during-restore", "during-extension", "optimizer-step", "grad-norm", "param-gather",
             "evaluation", "join-transfer", "checkpoint-save")
# Reached inside megatron's optimizer step, where the trainer does not call: the iteration is
# the one the trainer armed last.
OPTIMIZER_LOCATIONS = ("grad-norm", "param-gather")
# Reached only by jobs that evaluate, between iterations.
EVALUATION_LOCATIONS = ("evaluation",)
# Reached only between iterations at which standbys join.
JOIN_LOCATIONS = ("join-transfer",)
# Reached only by the ranks that write a checkpoint (the lowest live replica), after their part
# is on disk and before the tracker names it.
CHECKPOINT_LOCATIONS = ("checkpoint-save",)
# The locations every training iteration reaches.
ITERATION_LOCATIONS = tuple(loc for loc in LOCATIONS if loc not in OPTIMIZER_LOCATIONS
                            + EVALUATION_LOCATIONS + JOIN_LOCATIONS + CHECKPOINT_LOCATIONS)
STANDBY_LOCATIONS = ("idle", "join-transfer")


ACTIONS = ("kill", "stop", "stall", "raise", "device-error", "nan", "bitflip", "slow")
# The bit a bitflip flips by default: the fourth exponent bit of the element's type.
_MANTISSA_BITS = {"torch.float32": 23, "torch.bfloat16": 7, "torch.float16": 10,
                  "torch.float64": 52}
RAISED = ("raise", "device-error")  # actions that raise on the main thread
NATIVE_LOCATIONS = {"during-reduce": "reduce", "during-consensus": "consensus"}


class InjectedError(Exception):
    """The failure schedule's `raise` action: stands for a bug of the program or the data."""


@dataclass(frozen=True)
class ScheduleEntry:
    iteration: int
    replica: int
    local_rank: int
    location: str
    action: str = "kill"
    seconds: float = 0.0  # stall: how long; slow: the extra seconds per microbatch
    bit: int | None = None  # bitflip only: which bit of the element (None: the default)
    factor: float = 0.0  # slow only: how many times as long every pass takes
    until: int | None = None  # slow only: the last slowed iteration (None: to the end)
    bucket: int | None = None  # during-reduce only: the N-th bucket all-reduce, from 1


def load_schedule(path: Path, num_replicas: int, ranks_per_replica: int,
                  train_iters: int, standbys: int = 0) -> list[ScheduleEntry]:
    """Read and validate a schedule's entries alone (a run reads all of it: `FailureSchedule`)."""
    return _entries(path, _read(path), num_replicas, ranks_per_replica, train_iters, standbys)


def _read(path: Path):
    return yaml.safe_load(Path(path).read_text()) or {}


def _entries(path: Path, data, num_replicas: int, ranks_per_replica: int,
             train_iters: int, standbys: int) -> list[ScheduleEntry]:
    """Validate a schedule's entries; ValueError names the entry and what to change.
    `standbys`: the run's standby replicas (replica ids can then die more than once)."""
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path}: expected a top-level 'entries' list")
    entries = []
    for i, raw in enumerate(data["entries"]):
        keys = {"iteration", "replica", "local_rank", "location"}
        optional = {"action", "seconds", "bit", "factor", "until", "bucket"}
        if not isinstance(raw, dict) or not keys <= set(raw) <= keys | optional:
            raise ValueError(f"{path}: entry {i} must have the keys {sorted(keys)} "
                             f"(and optionally {', '.join(sorted(optional))})")
        entry = ScheduleEntry(int(raw["iteration"]), int(raw["replica"]), int(raw["local_rank"]),
                              str(raw["location"]), str(raw.get("action", "kill")),
                              float(raw.get("seconds", 0.0)),
                              None if raw.get("bit") is None else int(raw["bit"]),
                              float(raw.get("factor", 0.0)),
                              None if raw.get("until") is None else int(raw["until"]),
                              None if raw.get("bucket") is None else int(raw["bucket"]))
        if entry.action not in ACTIONS:
            raise ValueError(f"{path}: entry {i}: action '{entry.action}' is not one of "
                             f"{', '.join(ACTIONS)}")
        if entry.action == "slow":
            _check_slow(path, i, entry, train_iters)
        elif entry.factor or entry.until is not None:
            raise ValueError(f"{path}: entry {i}: 'factor' and 'until' go with action slow "
                             "(and only)")
        elif (entry.action == "stall") != (entry.seconds > 0):
            raise ValueError(f"{path}: entry {i}: 'seconds' goes with action stall or slow "
                             "(and only)")
        if entry.action == "stall" and entry.location in NATIVE_LOCATIONS:
            raise ValueError(f"{path}: entry {i}: a stall happens between operations, not "
                             f"inside {entry.location}")
        if entry.action in RAISED and (entry.location in NATIVE_LOCATIONS
                                       or entry.location in JOIN_LOCATIONS):
            raise ValueError(f"{path}: entry {i}: action {entry.action} raises on the main "
                             f"thread, which is not where {entry.location} happens: use a "
                             "Python-side location (pre-forward, backward, optimizer-step, ...)")
        if entry.action == "nan" and entry.location != "backward":
            raise ValueError(f"{path}: entry {i}: action nan poisons a microbatch's backward: "
                             "give it location backward")
        if entry.action == "bitflip" and entry.location != "before-reduce":
            raise ValueError(f"{path}: entry {i}: action bitflip corrupts a gradient bucket "
                             "before it is reduced: give it location before-reduce")
        if entry.bit is not None and (entry.action != "bitflip" or not 0 <= entry.bit < 64):
            raise ValueError(f"{path}: entry {i}: 'bit' goes with action bitflip (and only), "
                             "between 0 and 63")
        if entry.bucket is not None and (entry.location != "during-reduce"
                                         or entry.bucket < 1):
            raise ValueError(f"{path}: entry {i}: 'bucket' names the N-th bucket all-reduce "
                             "(from 1) of location during-reduce (and only)")
        if entry.location not in LOCATIONS:
            raise ValueError(f"{path}: entry {i}: location '{entry.location}' is not one of "
                             f"{', '.join(LOCATIONS)}")
        if not 0 <= entry.replica < num_replicas:
            raise ValueError(f"{path}: entry {i}: replica {entry.replica} does not exist "
                             f"(the run has replicas 0..{num_replicas - 1})")
        if not 0 <= entry.local_rank < ranks_per_replica:
            raise ValueError(f"{path}: entry {i}: local_rank {entry.local_rank} does not exist "
                             f"(a replica has ranks 0..{ranks_per_replica - 1})")
        if not 1 <= entry.iteration <= train_iters:
            raise ValueError(f"{path}: entry {i}: iteration {entry.iteration} is outside "
                             f"1..{train_iters}")
        entries.append(entry)
    victims = [(e.replica, e.local_rank, e.iteration if standbys else 0) for e in entries
               if e.action not in ("stall", "slow")]
    if len(set(victims)) != len(victims):
        raise ValueError(f"{path}: a rank can die only once; entries repeat a replica/local_rank"
                         + (" in one iteration" if standbys else ""))
    return entries


def _check_slow(path, i: int, entry: ScheduleEntry, train_iters: int) -> None:
    """A `slow` entry: at pre-forward, one of factor (> 1) or seconds (> 0), and `until` (if
    given) not before `iteration`."""
    if entry.location != "pre-forward":
        raise ValueError(f"{path}: entry {i}: action slow starts before a first pass: give it "
                         "location pre-forward")
    if (entry.factor > 0) == (entry.seconds > 0) or entry.factor < 0 or (
            entry.factor and entry.factor <= 1):
        raise ValueError(f"{path}: entry {i}: action slow takes either 'factor' (> 1: every "
                         "pass takes that many times as long) or 'seconds' (> 0: that much "
                         "longer per microbatch)")
    if entry.until is not None and not entry.iteration <= entry.until <= train_iters:
        raise ValueError(f"{path}: entry {i}: 'until' must be in {entry.iteration}.."
                         f"{train_iters} (the last slowed iteration)")


@dataclass(frozen=True)
class StandbyEntry:
    standby: int
    location: str


def _standby_entries(path: Path, data, standbys: int) -> list[StandbyEntry]:
    """The schedule's `standbys` list; ValueError names the entry and what to change."""
    raws = data.get("standbys", []) if isinstance(data, dict) else []
    if not isinstance(raws, list):
        raise ValueError(f"{path}: 'standbys' must be a list of {{standby, location}}")
    entries = []
    for i, raw in enumerate(raws):
        if not isinstance(raw, dict) or set(raw) != {"standby", "location"}:
            raise ValueError(f"{path}: standby entry {i} must have exactly the keys standby, "
                             "location")
        entry = StandbyEntry(int(raw["standby"]), str(raw["location"]))
        if not 0 <= entry.standby < standbys:
            raise ValueError(f"{path}: standby entry {i}: standby {entry.standby} does not exist "
                             f"(--recover-standby-replicas {standbys})")
        if entry.location not in STANDBY_LOCATIONS:
            raise ValueError(f"{path}: standby entry {i}: location '{entry.location}' is not one "
                             f"of {', '.join(STANDBY_LOCATIONS)}")
        entries.append(entry)
    if len({e.standby for e in entries}) != len(entries):
        raise ValueError(f"{path}: a standby can die only once; entries repeat a standby")
    return entries


@dataclass(frozen=True)
class Overflow:
    iteration: int
    microbatch_id: int


def _microbatches(path: Path, data, key: str, name: str, b_at,
                  train_iters: int) -> list[Overflow]:
    """The schedule's `overflows` or `bad_samples` (`key`); ValueError names the entry and what
    to change. `b_at(iteration)`: that iteration's B (its microbatch ids are 0..B-1)."""
    raws = data.get(key, []) if isinstance(data, dict) else []
    if not isinstance(raws, list):
        raise ValueError(f"{path}: '{key}' must be a list of {{iteration, microbatch_id}}")
    found = []
    for i, raw in enumerate(raws):
        if not isinstance(raw, dict) or set(raw) != {"iteration", "microbatch_id"}:
            raise ValueError(f"{path}: {name} {i} must have exactly the keys iteration, "
                             "microbatch_id")
        entry = Overflow(int(raw["iteration"]), int(raw["microbatch_id"]))
        if not 1 <= entry.iteration <= train_iters:
            raise ValueError(f"{path}: {name} {i}: iteration must be in 1..{train_iters}")
        b = b_at(entry.iteration)
        if not 0 <= entry.microbatch_id < b:
            raise ValueError(f"{path}: {name} {i}: microbatch_id must be in 0..{b - 1} (the "
                             f"ids of iteration {entry.iteration})")
        found.append(entry)
    return found


def _slow_snapshot_writes(path: Path, data, train_iters: int) -> dict[int, float]:
    """The schedule's `slow_snapshot_writes`: iteration -> seconds the writer pauses."""
    raws = data.get("slow_snapshot_writes", []) if isinstance(data, dict) else []
    if not isinstance(raws, list) or not all(isinstance(r, dict) and set(r) == {
            "iteration", "seconds"} for r in raws):
        raise ValueError(f"{path}: 'slow_snapshot_writes' must be a list of "
                         "{iteration, seconds}")
    pauses = {int(r["iteration"]): float(r["seconds"]) for r in raws}
    if any(not 1 <= t <= train_iters or seconds <= 0 for t, seconds in pauses.items()):
        raise ValueError(f"{path}: slow_snapshot_writes: iterations in 1..{train_iters}, "
                         "seconds > 0")
    return pauses


@dataclass(frozen=True)
class FailureSchedule:
    """A run's failure schedule (--recover-failure-schedule), read and validated once at
    start-up (`load`), every part of it."""

    path: Path
    entries: tuple[ScheduleEntry, ...]
    standbys: tuple[StandbyEntry, ...]  # kills of standby replicas
    overflows: tuple[Overflow, ...]  # forced fp16 overflows
    bad_samples: tuple[Overflow, ...]  # microbatches whose loss turns NaN wherever they run
    slow_snapshot_writes: dict[int, float]  # iteration -> seconds the snapshot writer pauses

    @classmethod
    def load(cls, path: Path, num_replicas: int, ranks_per_replica: int, train_iters: int,
             b_at, standbys: int = 0) -> "FailureSchedule":
        """Read `path` and check each part against the job; ValueError names the entry and
        what to change. `b_at(iteration)`: that iteration's B; `standbys`: the run's standby
        replicas."""
        data = _read(path)
        return cls(
            Path(path),
            tuple(_entries(path, data, num_replicas, ranks_per_replica, train_iters, standbys)),
            tuple(_standby_entries(path, data, standbys)),
            tuple(_microbatches(path, data, "overflows", "overflow", b_at, train_iters)),
            tuple(_microbatches(path, data, "bad_samples", "bad sample", b_at, train_iters)),
            _slow_snapshot_writes(path, data, train_iters))


def write_schedule(entries: list[ScheduleEntry], path: Path) -> None:
    Path(path).write_text(yaml.safe_dump({"entries": [asdict(e) for e in entries]},
                                         sort_keys=False))


def generate_schedule(num_replicas: int, ranks_per_replica: int, count: int, seed: int,
                      first_iteration: int, last_iteration: int,
                      locations: tuple[str, ...] | None = None) -> list[ScheduleEntry]:
    """A seeded random schedule: `count` distinct replicas die, at least one replica survives.
    By default at the locations every job reaches (not the optimizer-step collectives, which
    need --clip-grad or a distributed optimizer, nor evaluation, a standby's join or a
    checkpoint save)."""
    if locations is None:
        locations = ITERATION_LOCATIONS
    if count >= num_replicas:
        raise ValueError(f"--count {count} would kill every one of {num_replicas} replicas")
    unknown = set(locations) - set(LOCATIONS)
    if unknown:
        raise ValueError(f"unknown locations {sorted(unknown)}; choose from {', '.join(LOCATIONS)}")
    if not 1 <= first_iteration <= last_iteration:
        raise ValueError("--iterations A:B needs 1 <= A <= B")
    rng = random.Random(seed)
    replicas = rng.sample(range(num_replicas), count)
    entries = [ScheduleEntry(rng.randint(first_iteration, last_iteration), r,
                             rng.randrange(ranks_per_replica), rng.choice(locations))
               for r in replicas]
    return sorted(entries, key=lambda e: (e.iteration, e.replica))


class ScheduledFaults:
    """The entries that concern this rank, fired at their points by the trainer."""

    def __init__(self, entries: list[ScheduleEntry], replica: int, local_rank: int,
                 world_rank: int, marker_path: Path, overflows: list[Overflow] = (),
                 bad_samples: list[Overflow] = ()):
        self.mine = [e for e in entries if (e.replica, e.local_rank) == (replica, local_rank)]
        self.overflows = {(o.iteration, o.microbatch_id) for o in overflows}
        self.bad_samples = {(o.iteration, o.microbatch_id) for o in bad_samples}
        self.iteration = 0  # the iteration in progress (set by arm_iteration)
        self._group = None  # a group with an armed native point (phase reports go to it)
        self.world_rank = world_rank
        self.marker_path = Path(marker_path)
        self._flipped: set[ScheduleEntry] = set()
        self._slowed: set[ScheduleEntry] = set()

    def _due(self, location: str, iteration: int,
             flips: bool = False) -> ScheduleEntry | None:
        for entry in self.mine:
            if (entry.location == location and entry.iteration == iteration
                    and entry.action != "slow" and (entry.action == "bitflip") == flips):
                return entry
        return None

    def at(self, location: str, iteration: int) -> bool:
        """A Python-side point: die, freeze or stall here if scheduled. True when the caller is
        to poison the gradient of the microbatch at hand (action `nan`)."""
        entry = self._due(location, iteration)
        if entry is None:
            return False
        write_marker(self.marker_path, location, self.world_rank,
                     {"location": location, "iteration": iteration, "action": entry.action})
        if entry.action == "nan":
            return True
        if entry.action == "stall":
            end = time.monotonic() + entry.seconds
            while time.monotonic() < end:  # busy, like a long kernel: no communication at all
                pass
            return
        if entry.action == "raise":
            raise InjectedError(f"failure schedule: a program error at {location} of "
                                f"iteration {iteration}")
        if entry.action == "device-error":
            raise DeviceFault(f"failure schedule: a device fault at {location} of iteration "
                              f"{iteration}")
        os.kill(os.getpid(), signal.SIGSTOP if entry.action == "stop" else signal.SIGKILL)

    def slow_down(self, iteration: int, microbatches: int, seconds) -> None:
        """Action `slow`: a pass of `microbatches` took `seconds()`; sleep what a device slowed
        by the entry's factor (or by its seconds per microbatch) would have added. The first
        slowed pass leaves a marker."""
        for entry in self.mine:
            if entry.action != "slow" or not entry.iteration <= iteration <= (
                    entry.until if entry.until is not None else iteration):
                continue
            if entry not in self._slowed:
                self._slowed.add(entry)
                write_marker(self.marker_path, "pre-forward", self.world_rank,
                             {"location": "pre-forward", "iteration": iteration,
                              "action": "slow", "factor": entry.factor,
                              "seconds": entry.seconds, "until": entry.until})
            time.sleep(max(0.0, (entry.factor - 1) * seconds()) if entry.factor
                       else entry.seconds * microbatches)

    def corrupt(self, iteration: int, grad) -> None:
        """Action `bitflip`: flip one bit of an element of `grad` (`flip_target`), once (a
        marker names the element, the bit and the values before and after)."""
        entry = self._due("before-reduce", iteration, flips=True)
        if entry is None or entry in self._flipped:
            return
        self._flipped.add(entry)
        flat = grad.view(-1)
        element = flip_target(flat)
        bit = _MANTISSA_BITS[str(grad.dtype)] + 4 if entry.bit is None else entry.bit
        before = float(flat[element])
        flip_bit(flat[element:element + 1], bit)
        write_marker(self.marker_path, "before-reduce", self.world_rank,
                     {"location": "before-reduce", "iteration": iteration, "action": "bitflip",
                      "element": element, "bit": bit, "before": before,
                      "after": float(flat[element])})

    def overflow(self, iteration: int, microbatch_id: int) -> bool:
        """Whether this microbatch's backward is to overflow (leaves a marker when it does)."""
        return self._listed(self.overflows, "overflow", iteration, microbatch_id)

    def bad_sample(self, iteration: int, microbatch_id: int) -> bool:
        """Whether this microbatch's loss is to be NaN (leaves a marker when it is)."""
        return self._listed(self.bad_samples, "bad-sample", iteration, microbatch_id)

    def _listed(self, listed: set, location: str, iteration: int, microbatch_id: int) -> bool:
        """Whether (iteration, microbatch_id) is in `listed`; leaves a marker at `location`."""
        if (iteration, microbatch_id) not in listed:
            return False
        write_marker(self.marker_path, location, self.world_rank,
                     {"location": location, "iteration": iteration,
                      "microbatch_id": microbatch_id})
        return True

    def wants(self, location: str) -> bool:
        """Whether any of this rank's entries is at `location`."""
        return any(entry.location == location for entry in self.mine)

    def phase(self, phase: str) -> None:
        """The main thread enters `phase` (the "phase" of a native point's marker)."""
        if self._group is not None:
            self._group.set_fault_phase(phase)

    def at_current(self, location: str) -> None:
        """`at(location, the iteration in progress)`, for points inside megatron's own calls."""
        self.at(location, self.iteration)

    def arm_join(self, group, iteration: int) -> None:
        """Arm `join-transfer` of the join after `iteration` (call before its transfer)."""
        entry = self._due("join-transfer", iteration)
        if entry is not None:
            _arm_transfer(group, self.marker_path, {"iteration": iteration,
                                                    "location": "join-transfer"})

    def arm_iteration(self, group, iteration: int, bucket_index: int) -> None:
        """Arm the native points of `iteration` (reduce: its `bucket_index`-th bucket, from 1)."""
        self.iteration = iteration
        for location, point in NATIVE_LOCATIONS.items():
            entry = self._due(location, iteration)
            if entry is None:
                continue
            self._group = group  # armed: its marker reports the phase
            nth = (entry.bucket or bucket_index) if point == "reduce" else 1
            fields = {"iteration": iteration, "location": location, "action": entry.action}
            if point == "reduce":
                fields["bucket"] = nth
            group.arm_fault(point, group.fault_hits(point) + nth, entry.action, 0.0,
                            str(self.marker_path), fields)


def _arm_transfer(group, marker_path: Path, fields: dict) -> None:
    """Kill this rank entering the state broadcast of a join: the transfer's third broadcast,
    its first pack of tensors (the first two carry the structure's size and the structure:
    `transfer.broadcast_state`)."""
    group.arm_fault("broadcast", group.fault_hits("broadcast") + 3, "kill", 0.0,
                    str(marker_path), {**fields, "action": "kill"})


class StandbyFaults:
    """A standby's own entries (the schedule's `standbys` list), before it joins."""

    def __init__(self, entries: list[StandbyEntry], standby: int, world_rank: int,
                 marker_path: Path):
        self.mine = {e.location for e in entries if e.standby == standby}
        self.standby = standby
        self.world_rank = world_rank
        self.marker_path = Path(marker_path)

    def idle(self) -> None:
        """The standby starts waiting: die here if scheduled."""
        if "idle" in self.mine:
            write_marker(self.marker_path, "idle", self.world_rank,
                         {"location": "idle", "standby": self.standby, "action": "kill"})
            os.kill(os.getpid(), signal.SIGKILL)

    def arm_join(self, group, iteration: int) -> None:
        """Die entering the state broadcast of this standby's join (after `iteration`)."""
        if "join-transfer" in self.mine:
            self.mine.discard("join-transfer")
            _arm_transfer(group, self.marker_path, {"iteration": iteration,
                                                    "location": "join-transfer",
                                                    "standby": self.standby})


def injection_report(entries: list[ScheduleEntry], marker_path: Path,
                     rank_of: dict[tuple[int, int], int]) -> dict:
    """Which entries fired (by the victims' markers) and which were never reached."""
    fired = {(m.get("rank"), m.get("iteration"), m.get("location"))
             for m in read_markers(marker_path)}
    injected, not_injected = [], []
    for entry in entries:
        key = (rank_of[(entry.replica, entry.local_rank)], entry.iteration, entry.location)
        (injected if key in fired else not_injected).append(asdict(entry))
    return {"injected": injected, "not_injected": not_injected}


def flip_target(flat) -> int:
    """The element a bitflip corrupts: the first non-zero one from the middle of the flat
    tensor on (the middle one if none is). An exponent bit of a zero changes it by less than
    any sum's rounding: that flip would be harmless and, to the fingerprints, invisible."""
    middle = flat.numel() // 2
    nonzero = flat[middle:].nonzero()
    return middle + int(nonzero[0, 0]) if nonzero.numel() else middle


def flip_bit(element, bit: int) -> None:
    """Flip bit `bit` of every element of the tensor `element` in place (its bits as an
    integer)."""
    import torch  # not at import: `megatron-recover schedule` reads this module without torch

    size = element.element_size()
    if not 0 <= bit < 8 * size:
        raise ValueError(f"bit {bit} outside a {size}-byte element")
    mask = 1 << bit
    if mask >= 1 << (8 * size - 1):
        mask -= 1 << (8 * size)  # the sign bit, as the signed integer type holds it
    integer = {8: torch.int64, 4: torch.int32, 2: torch.int16}[size]
    element.view(integer).bitwise_xor_(mask)


class NoFaults:
    """Stands in for ScheduledFaults when a run has no failure schedule."""

    def at(self, location: str, iteration: int) -> bool:
        return False

    def corrupt(self, iteration: int, grad) -> None:
        pass

    def slow_down(self, iteration: int, microbatches: int, seconds) -> None:
        pass

    def overflow(self, iteration: int, microbatch_id: int) -> bool:
        return False

    def bad_sample(self, iteration: int, microbatch_id: int) -> bool:
        return False

    def wants(self, location: str) -> bool:
        return False

    def phase(self, phase: str) -> None:
        pass

    def arm_iteration(self, group, iteration: int, bucket_index: int) -> None:
        pass

    def arm_join(self, group, iteration: int) -> None:
        pass

    def idle(self) -> None:
        pass
