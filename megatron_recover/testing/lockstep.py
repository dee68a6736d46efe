"""Several replicas of the round protocol stepped in one process, for the unit tier.

Each replica is one rank on its own thread, with the real `ResilientTrainer`,
`GradientRecovery`, `WorkloadPolicy` and `DatasetAudit`, over fakes of what megatron provides:

  * `FakeDataset`: samples of tokens, labels and a loss mask, a deterministic function of the
    sample index (any index: reserve ids read past the main stream).
  * `FakeBuffers`: gradient buckets of several sizes, float64 (megatron's buckets are flat
    tensors the backward accumulates into).
  * `FakePass`: runs microbatch ids as megatron's schedule would for the protocol: fetches the
    id's samples (Megatron's sample order), registers the microbatch in the ledger with the
    checksum of what it fetched, and adds the id's gradient to every bucket. A gradient is small
    integers drawn from a generator seeded by the samples' checksum, so every sum of gradients is
    exact in float64 whatever the grouping: a committed gradient equals its expectation bitwise,
    and survivors equal the failure-free run bitwise.
  * `FakeOptimizer`: SGD on one flat parameter vector with step 1/8 (exact in binary).
  * `FakeFaults`: the failure schedule's named points, killing the rank's thread; and silent
    corruption for sampled verification: `bitflip` flips a bit of the first bucket before its
    first reduction (the schedule's action), `faulty` adds 1 to an element after every pass the
    replica runs in that iteration (a device that is wrong whatever it computes); and non-finite
    gradients for the reruns: `nan` makes an element of the first bucket NaN before its first
    reduction, once (a transient fault), `nan-always` after every pass the replica runs in that
    iteration (a faulty device), and `Setup.nan_ids` make a microbatch's gradient NaN wherever
    it runs (bad data); and stragglers: `Setup.slow` makes a replica sleep after each pass, as
    the schedule's `slow` action does.

`run_lockstep(Setup)` runs the iterations and returns what every rank saw; `expected_gradient`
computes a committed gradient from the dataset alone, without the protocol.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from megatron_recover.faults.schedule import flip_bit, flip_target
from megatron_recover.megatron.data.audit import DatasetAudit
from megatron_recover.megatron.data.datasets import batch_checksum
from megatron_recover.policy import ADAPTIVE, PolicyConfig, WorkloadPolicy
from megatron_recover.policy.speed import StragglerConfig
from megatron_recover.recovery import ResilientTrainer, StepReport, TrainerParts
from megatron_recover.recovery.verification import Verification
from megatron_recover.testing.fake_ulfm import FakeTorchPlane, FakeWorld, RankKilled

SEQ_LENGTH = 8
BUCKETS = (40, 24, 8)  # elements per gradient bucket
LEARNING_RATE = 0.125

# Where a replica can die: the trainer's named points, and inside the collectives.
TRAINER_POINTS = ("pre-forward", "before-reduce", "after-post", "during-restore",
                  "during-extension", "optimizer-step")
COLLECTIVE_POINTS = ("during-reduce", "reduce-contributed", "during-lane", "in-consensus")
LOCATIONS = TRAINER_POINTS + COLLECTIVE_POINTS
CORRUPTIONS = ("bitflip", "faulty")  # silent: the replica goes on computing
FLIPPED_BIT = 56  # the fourth exponent bit of a float64: the element scaled by 2^16


class FakeDataset:
    """Sample i: tokens and labels from a generator seeded by i, some positions masked."""

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(1_000_003 * index + 17)
        tokens = torch.randint(0, 97, (SEQ_LENGTH,), generator=generator)
        loss_mask = (torch.rand(SEQ_LENGTH, generator=generator) > 0.25).float()
        return {"tokens": tokens, "labels": torch.roll(tokens, -1), "loss_mask": loss_mask}


def sample_range(audit: DatasetAudit, iteration: int, microbatch_id: int) -> range:
    """The samples of microbatch `microbatch_id` of `iteration` (Megatron's order; reserve ids
    past the main stream)."""
    mbs = audit.mbs
    if microbatch_id < audit.b:
        first = audit.global_batch(iteration)[0] + microbatch_id * mbs
    else:
        first = audit.main_samples + (microbatch_id - audit.b) * mbs
    return range(first, first + mbs)


def microbatch(dataset, samples: range) -> tuple[int, int, float]:
    """(checksum, loss tokens, loss summed over those tokens) of the samples."""
    batch = [dataset[i] for i in samples]
    tokens, labels, mask = (torch.stack([s[k] for s in batch])
                            for k in ("tokens", "labels", "loss_mask"))
    checksum = batch_checksum(tokens, labels, mask)
    return checksum, int(mask.sum().item()), (checksum % 1000) / 64.0


def gradient(checksum: int) -> list[torch.Tensor]:
    """A microbatch's gradient, per bucket: integers in [-8, 8] seeded by its checksum."""
    generator = torch.Generator().manual_seed(checksum)
    return [torch.randint(-8, 9, (n,), generator=generator).double() for n in BUCKETS]


class FakeBuffers:
    def __init__(self):
        self.grads = [torch.zeros(n, dtype=torch.float64) for n in BUCKETS]
        self.passes = 0

    def buckets(self):
        return list(self.grads)

    def synced(self):
        return []

    def chunk_buckets(self):
        return None

    def deferred(self):
        return []

    def zero(self):
        for grad in self.grads:
            grad.zero_()

    def scale(self, factor):
        for grad in self.grads:
            grad.mul_(factor)

    def new_pass(self):
        self.passes += 1

    def dispatch_param_gather(self):
        pass

    def wait_param_gather(self):
        pass


class FakePass:
    """Runs ids into the buffers; the trainer is attached once built (`Replica.__init__`)."""

    def __init__(self, replica: "Replica"):
        self.replica = replica
        self.divisors: list[int] = []
        self.ran: list[tuple[int, int]] = []  # (iteration, id) in the order run
        self.padding: list[int] = []  # each pass's padding microbatches (they add nothing)

    def __call__(self, iteration, ids, divisor, losses, tokens, padding, sink):
        replica = self.replica
        self.padding.append(padding)
        self.divisors.append(divisor)
        for k in ids:
            checksum, count, loss = microbatch(replica.dataset,
                                               sample_range(replica.audit, iteration, k))
            for grad, part in zip(replica.buffers.grads, gradient(checksum)):
                grad.add_(part)
            if (iteration, k) in replica.nan_ids:
                replica.buffers.grads[0][5] = float("nan")
            sink.register(iteration, k, checksum)
            losses[k] = loss
            tokens[k] = count
            self.ran.append((iteration, k))
        if ids and replica.faults.faulty(iteration):
            replica.buffers.grads[0][3] += 1.0
        if ids and replica.faults.faulty(iteration, "nan-always"):
            replica.buffers.grads[0][3] = float("nan")
        # The last microbatch's backward completes every bucket, first bucket first (what the
        # patched megatron reports through hooks.start_grad_sync).
        for grad in replica.buffers.grads:
            replica.trainer.recovery.bucket_ready([grad])


class FakeOptimizer:
    def __init__(self, buffers: FakeBuffers):
        self.buffers = buffers
        self.params = torch.zeros(sum(BUCKETS), dtype=torch.float64)
        self.stepped: list[torch.Tensor] = []  # the gradient of each step, in order
        self.microbatches: list[int] = []  # what each step advanced the schedule by

    def zero_grad(self):
        pass

    def step(self, microbatches):
        grad = torch.cat(self.buffers.grads).clone()
        self.stepped.append(grad)
        self.microbatches.append(microbatches)
        self.params.sub_(LEARNING_RATE * grad)
        return True, float(grad.norm())

    def loss_scale(self):
        return 1.0


@dataclass(frozen=True)
class Failure:
    """Replica `replica` dies at `location` of `iteration` (`occurrence`: for during-reduce,
    the bucket; `lucky`: with reduce-contributed, the replicas whose reduce completes)."""

    replica: int
    iteration: int
    location: str
    occurrence: int = 1
    lucky: tuple[int, ...] = ()


class FakeFaults:
    def __init__(self, world: FakeWorld, rank: int, failures: list[Failure],
                 slow: tuple = ()):
        self.world = world
        self.rank = rank
        self.slow = slow
        self.failures = [f for f in failures if f.replica == rank]
        self.flipped: set[Failure] = set()

    def at(self, location, iteration):
        for f in self.failures:
            if (f.iteration, f.location) == (iteration, location):
                self.world.kill(self.rank, f"at {location} of iteration {iteration}")

    def corrupt(self, iteration, grad):
        for f in self.failures:
            if f.iteration != iteration or f in self.flipped:
                continue
            if f.location == "bitflip":
                self.flipped.add(f)
                element = flip_target(grad)
                flip_bit(grad[element:element + 1], FLIPPED_BIT)
            elif f.location == "nan":
                self.flipped.add(f)
                grad[flip_target(grad)] = float("nan")

    def slow_down(self, iteration, microbatches, seconds):
        for replica, first, last, per_microbatch in self.slow:
            if replica == self.rank and first <= iteration <= last:
                time.sleep(per_microbatch * microbatches)

    def faulty(self, iteration, kind: str = "faulty") -> bool:
        return any((f.iteration, f.location) == (iteration, kind) for f in self.failures)

    def arm_iteration(self, group, iteration, bucket_index):
        for f in self.failures:
            if f.iteration != iteration:
                continue
            if f.location == "during-reduce":
                self.world.arm(self.rank, ops=f.occurrence)
            elif f.location == "reduce-contributed":
                self.world.arm(self.rank, ops=f.occurrence, contributed=True, lucky=f.lucky)
            elif f.location == "during-lane":
                self.world.arm(self.rank, ops=len(BUCKETS) + 1)
            elif f.location == "in-consensus":
                self.world.arm(self.rank, ops=0)


class RecordingAudit(DatasetAudit):
    """The real audit, keeping each committed ledger (what actually happened)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.totals = {}

    def committed(self, totals):
        super().committed(totals)
        self.totals[len(self.totals) + 1] = totals


@dataclass(frozen=True)
class Setup:
    w_init: int
    g_init: int
    iterations: int = 3
    policy: str = "static"
    mode: str = "exact"
    overlap: bool = False
    failures: tuple[Failure, ...] = ()
    micro_batch_size: int = 1
    restore: bool = True  # False: the negative control
    sdc_check_rate: float = 0.0  # sampled verification (0: off)
    seed: int = 1234
    nonfinite_rerun: str = "off"  # --recover-nonfinite-rerun
    nan_ids: tuple[tuple[int, int], ...] = ()  # (iteration, id): a NaN gradient anywhere
    straggler: StragglerConfig = StragglerConfig()  # balancing and eviction (off)
    # (replica, first iteration, last iteration, seconds per microbatch): a slowed replica
    slow: tuple[tuple[int, int, int, float], ...] = ()
    side: bool = False  # side values summed like the loss (`side_values`)
    plane: str = "mpi"  # the cross-replica data plane: the fake ulfm group, or "torch" over it


def side_values(iteration: int, counts: dict[int, int]) -> list[float]:
    """Microbatch id k of iteration t has the side values (1000 t + k + 1, 1): summed over a
    ledger's `counts` (id -> how often it holds it)."""
    return [float(sum(n * (1000 * iteration + k + 1) for k, n in counts.items())),
            float(sum(counts.values()))]


class Replica:
    def __init__(self, setup: Setup, world: FakeWorld, rank: int):
        config = PolicyConfig(w_init=setup.w_init, g_init=setup.g_init, policy=setup.policy,
                              mode=setup.mode, straggler=setup.straggler)
        b = config.b
        self.dataset = FakeDataset()
        self.audit = RecordingAudit(self.dataset, global_batch_size=b * setup.micro_batch_size,
                                    micro_batch_size=setup.micro_batch_size,
                                    main_samples=setup.iterations * b * setup.micro_batch_size,
                                    policy=setup.policy, mode=setup.mode)
        self.buffers = FakeBuffers()
        self.optimizer = FakeOptimizer(self.buffers)
        self.run_pass = FakePass(self)
        self.faults = FakeFaults(world, rank, list(setup.failures), setup.slow)
        self.nan_ids = set(setup.nan_ids)
        verification = (Verification(setup.sdc_check_rate, setup.seed)
                        if setup.sdc_check_rate > 0 else None)
        self.trainer = ResilientTrainer(TrainerParts(
            buffers=self.buffers, run_pass=self.run_pass, optimizer=self.optimizer,
            group=(world.group(rank) if setup.plane == "mpi"
                   else FakeTorchPlane(world.group(rank))),
            policy=WorkloadPolicy(config), replica=rank,
            replica_of_rank={r: r for r in range(setup.w_init)},
            faults=self.faults, audit=self.audit, overlap_grad_reduce=setup.overlap,
            restore=setup.restore, verification=verification, check_finite=True,
            nonfinite_rerun=setup.nonfinite_rerun,
            samples_of=lambda iteration, k: sample_range(self.audit, iteration, k),
            side_size=2 if setup.side else 0, side_sums=side_values if setup.side else None))


@dataclass
class RankRun:
    reports: list[StepReport] = field(default_factory=list)
    killed: str | None = None  # where it died
    error: BaseException | None = None  # anything else it raised
    replica: Replica | None = None


def run_lockstep(setup: Setup, timeout_s: float = 60.0) -> tuple[dict[int, RankRun], FakeWorld]:
    """Run every replica's iterations on its own thread; returns what each rank saw."""
    world = FakeWorld(range(setup.w_init), timeout_s=timeout_s)
    runs = {rank: RankRun() for rank in range(setup.w_init)}

    def body(rank: int) -> None:
        run = runs[rank]
        try:
            run.replica = Replica(setup, world, rank)
            for iteration in range(1, setup.iterations + 1):
                run.reports.append(run.replica.trainer.train_step(iteration))
        except RankKilled as killed:
            run.killed = str(killed)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            run.error = error
            world.kill_quietly(rank)

    threads = [threading.Thread(target=body, args=(rank,), daemon=True)
               for rank in range(setup.w_init)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s * 4)
        if thread.is_alive():
            raise AssertionError(f"a replica thread still runs after {timeout_s * 4} s")
    return runs, world


def expected_gradient(setup: Setup, audit: DatasetAudit, iteration: int, totals) -> torch.Tensor:
    """The gradient a commit of `totals` must step on, from the dataset alone: each held id's
    gradient as often as the ledger holds it, divided as the policy divides (drop-and-go
    rescales by B over the committed count)."""
    total = torch.zeros(sum(BUCKETS), dtype=torch.float64)
    held = [(k, n) for k, n in enumerate(totals.main_counts) if n]
    held += [(k, 1) for k in totals.reserve]
    for k, n in held:
        checksum = microbatch(audit.dataset, sample_range(audit, iteration, k))[0]
        total += n * torch.cat(gradient(checksum))
    buckets = torch.split(total, BUCKETS)
    if setup.policy == ADAPTIVE and totals.count != audit.b:
        for part in buckets:
            part.mul_(audit.b / totals.count)
    return torch.cat(buckets)


def failure_free_gradient(audit: DatasetAudit, iteration: int) -> torch.Tensor:
    """Ids 0..B-1 of the iteration, each once: the failure-free run's gradient."""
    total = torch.zeros(sum(BUCKETS), dtype=torch.float64)
    for k in range(audit.b):
        total += torch.cat(gradient(microbatch(audit.dataset,
                                               sample_range(audit, iteration, k))[0]))
    return total


def assert_failure_free_steps(runs: dict[int, RankRun], replicas, iterations: int) -> None:
    """Each of `replicas` stepped `iterations` times, each time on the failure-free gradient
    computed from the dataset alone."""
    for rank in replicas:
        replica = runs[rank].replica
        assert len(replica.optimizer.stepped) == iterations, (rank, runs[rank].error)
        for t in range(1, iterations + 1):
            expected = failure_free_gradient(replica.audit, t)
            assert torch.equal(replica.optimizer.stepped[t - 1], expected), (rank, t)
