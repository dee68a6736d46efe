"""Layer 2: epoch-tagged gradient-bucket snapshots, rewind and re-reduce.

Before a bucket is reduced across replicas its pre-reduce contents are copied into a snapshot,
and — on a replica that does not contribute (a spare) — the bucket is zeroed, so the spare's real
gradient survives in the snapshot for a promotion. Each reduction is tagged with the epoch it
completed under. A bucket is *valid* only if its reduction succeeded under the epoch the
survivors agreed on and the contributions it summed are still the ones the policy wants; every
other bucket is *stale*: it is rewound from its snapshot and reduced again under the new
membership. So every bucket of a committed iteration was reduced exactly once, by one membership.

With a distributed optimizer inside each replica (Megatron's HSDP form) a bucket's reduction is
two steps: a reduce-scatter over the replica's shard group (in place: this rank's shard of the
bucket receives the replica's sum), then the ulfm all-reduce of that shard across replicas. The
snapshot is taken before the reduce-scatter, so a rewind — or an extension pass that adds the
snapshot back — starts again from this rank's own gradient and no shard is counted twice.

Every bucket carries a gradient ledger (`ledger.py`) that each of these operations updates as it
updates the gradient; `sent_ledger()` is what this rank's buckets handed to their latest
reductions, the evidence the commit lane carries.

Overlapped (--overlap-grad-reduce, first passes only): while megatron's schedule runs, megatron
reports each bucket whose gradients its last microbatch completed (`bucket_ready`), and the
buckets are posted from there, during backward, in one fixed order: a bucket goes out once every
bucket before it in that order went out. Buckets that megatron syncs in place inside the replica
after backward (`deferred`: a tied embedding with pipeline stages, sequence-parallel norms) come
last in the order and are posted only after the schedule returned, with the rest (`reduce_all`),
so a reduction in flight never races such a sync and the snapshot holds the synced gradient. A
rank with nothing to run posts everything in that same order. With distributed-optimizer shards
the reduce-scatter is posted asynchronously too (on gloo, whose asynchronous reduce-scatter only
progresses inside wait(), an all-reduce of the bucket: the shard receives the same sum), and
each bucket's ulfm all-reduce follows its reduce-scatter: at megatron's next report the main
thread waits for the reduce-scatters posted at the previous one and posts their all-reduces, in
order (the last ones: `wait`). So the reduce-scatters overlap the backward between two reports,
at most one report's worth is in flight, and every all-reduce but the last ones' goes out during
backward whatever the scheduling. No thread of ours is involved (a Python helper would wait for
the GIL while backward holds it); an error of the reduce-scatter surfaces on the main thread
and takes the exit-hook path (`runtime`).

Contract: all members of the group post the same buckets in the same order (`reduce_all` after
each pass). `wait()` never raises for a peer failure; failures come back as records.
"""

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megatron_recover.collective import FailureRecord, ULFMGroup, ULFMWork
from megatron_recover.errors import NonFiniteResult
from megatron_recover.recovery.ledger import Entry, Ledger


@dataclass(frozen=True)
class PassMode:
    """How one round of reductions (`GradientRecovery.begin_pass`) treats this rank's buckets,
    fixed when the round starts."""

    # False: each bucket is snapshotted, then zeros and an empty ledger are sent (a spare, a
    # replica whose contribution is held out).
    contributing: bool = True
    # A bucket that fails the NaN/inf check is held out (zeros are sent from it on, and
    # `nonfinite` says so) instead of raising (`rerun.py`).
    hold_nonfinite: bool = False
    # `fingerprint(index, grad)` of each bucket as it is handed to its reduction, kept in
    # `fingerprints` (sampled verification); None: none taken.
    fingerprint: Callable[[int, torch.Tensor], torch.Tensor] | None = None


@dataclass
class _Bucket:
    grad: torch.Tensor
    snapshot: torch.Tensor
    shard: torch.Tensor  # what the ulfm all-reduce sums: the whole bucket, or this rank's shard
    shard_group: object | None = None  # the torch group of the bucket's other shards
    reduced_epoch: int | None = None  # epoch of the last successful reduction, None: not reduced
    work: ULFMWork | None = None
    ledger: Ledger = field(default_factory=Ledger)  # what `grad` holds now
    snapshot_ledger: Ledger = field(default_factory=Ledger)  # what `snapshot` holds
    sent: Ledger | None = None  # what the latest reduction of this pass summed from this rank
    deferred: bool = False  # posted after the pass (overlapped: a `synced` bucket)
    synced: bool = False  # synced in place inside the replica after backward (any mode)
    ready: bool = False  # overlapped pass: megatron found the bucket's gradients complete
    index: int = 0  # its place in the reduction order


class GradientRecovery:
    """The cross-replica reduction of one rank's gradient buckets, with rewind."""

    def __init__(self, group: ULFMGroup, grads: list[torch.Tensor], before_first_reduce=None,
                 shard_group=None, deferred: list[torch.Tensor] = (), after_first_post=None,
                 check_finite: bool = False, restore_stream=None,
                 synced: list[torch.Tensor] = (), shard_groups: dict | None = None,
                 chunk_buckets: list[list[torch.Tensor]] | None = None):
        """`grads`: the gradient buckets, in the order every member reduces them (`deferred`
        ones, synced inside the replica after backward, moved to the end).
        `before_first_reduce()` runs before the first reduction of each pass is posted,
        `after_first_post()` right after its first ulfm all-reduce was (fault points).
        `shard_group`: with a distributed optimizer in the replica, the torch group of the ranks
        holding the other shards of these buckets (Megatron's intra-instance data-parallel
        group); None without one. `shard_groups`: the buckets sharded over another group, by
        data_ptr (expert buckets: Megatron's intra-instance expert data-parallel group); a
        group of one rank means no reduction inside the replica. `check_finite`: Megatron's
        check_for_nan_in_grad, before every reduction (`reduce_bucket`). `restore_stream`: a
        side CUDA stream for the non-blocking restore (`rewind_under_pass`), None on the CPU.
        `synced`: the buckets megatron syncs in place inside the replica after backward, in
        any mode (the non-blocking restore empties them rather than rewinding them).
        `chunk_buckets`: with virtual pipeline stages, each model chunk's buckets (a microbatch
        a chunk consumed is registered in that chunk's buckets only); None: one chunk."""
        self.group = group
        self.restore_stream = restore_stream
        self._restore_event = None  # the side-stream rewind's end, until the compute stream waits
        self.check_finite = check_finite
        self.shard_group = shard_group
        self.shard_groups = dict(shard_groups or {})
        self.mode = PassMode()
        self.before_first_reduce = before_first_reduce
        self.after_first_post = after_first_post
        self._buckets: dict[int, _Bucket] = {}  # data_ptr of the bucket -> state, in order
        late = {grad.data_ptr() for grad in deferred}
        for grad in [g for g in grads if g.data_ptr() not in late] + list(deferred):
            self._state(grad).deferred = grad.data_ptr() in late
        for grad in synced:
            self._state(grad).synced = True
        self._chunk_buckets = chunk_buckets
        self._posted_in_pass = 0
        self._allreduced = False  # a ulfm all-reduce was posted in this pass
        self.intervals: list[tuple[float, float]] = []  # the last wait's reductions: (start, end)
        self.overlap = False  # megatron's bucket_ready calls post buckets (during backward)
        self._overlapped = False  # this pass posted during backward
        # Shards, overlapped: (bucket, its reduce-scatter in flight), in posting order.
        self._scattering: list[tuple[_Bucket, object]] = []
        # This pass's bucket fingerprints, by bucket index (`PassMode.fingerprint`).
        self.fingerprints: dict[int, torch.Tensor] = {}
        # A bucket failed the NaN/inf check in a pass that holds it out (`PassMode`): this rank
        # sends zeros and an empty ledger from that bucket on, as a spare does, for the rest of
        # the iteration (or until a kept rerun, `keep_rerun`).
        self.nonfinite = False

    def _state(self, grad: torch.Tensor) -> _Bucket:
        key = grad.data_ptr()
        if key not in self._buckets:
            group = self.shard_groups.get(key, self.shard_group)
            if key in self.shard_groups and dist.get_world_size(group) == 1:
                group = None  # its own shard: nothing to reduce inside the replica
            self._buckets[key] = _Bucket(grad=grad, snapshot=torch.empty_like(grad),
                                         shard=self._shard(grad, group), shard_group=group,
                                         index=len(self._buckets))
        return self._buckets[key]

    @staticmethod
    def _shard(grad: torch.Tensor, group) -> torch.Tensor:
        """This rank's contiguous 1/S of the bucket, as Megatron's distributed optimizer owns it."""
        if group is None:
            return grad
        shards = dist.get_world_size(group)
        if grad.numel() % shards:
            raise ValueError(f"a gradient bucket of {grad.numel()} elements does not split into "
                             f"{shards} distributed-optimizer shards")
        size = grad.numel() // shards
        return grad.view(-1).narrow(0, dist.get_rank(group) * size, size)

    def begin_iteration(self) -> None:
        """The gradient buffers were just zeroed for a new iteration: every ledger is empty."""
        self.nonfinite = False
        for bucket in self._buckets.values():
            bucket.ledger.clear()
            bucket.snapshot_ledger.clear()

    def begin_pass(self, mode: PassMode = PassMode()) -> None:
        """A new round of reductions starts, in `mode`: nothing is posted or reduced in it yet."""
        self.mode = mode
        self.fingerprints = {}
        for bucket in self._buckets.values():
            assert bucket.work is None, "begin_pass with reductions in flight"
            bucket.reduced_epoch = None
            bucket.sent = None
            bucket.ready = False
        self._posted_in_pass = 0
        self._allreduced = False  # a ulfm all-reduce was posted in this pass
        self.overlap = False
        self._overlapped = False
        assert not self._scattering, "begin_pass with reduce-scatters in flight"

    def start_overlap(self) -> None:
        """This pass posts each bucket as soon as megatron finds it complete (its backward)."""
        self.overlap = True
        self._overlapped = True

    def stop_overlap(self) -> None:
        """The schedule returned: what is left is posted by `reduce_all`."""
        self.overlap = False

    def bucket_ready(self, grads: list[torch.Tensor]) -> None:
        """Megatron found these buckets' gradients complete in the last microbatch's backward:
        post every bucket whose turn has come (nothing outside an overlapped pass)."""
        if not self.overlap:
            return
        self._post_scattered()
        for grad in grads:
            self._buckets[grad.data_ptr()].ready = True
        for bucket in self._buckets.values():
            if bucket.sent is not None:
                continue  # posted in this pass
            if bucket.deferred or not bucket.ready:
                return
            self.reduce_bucket(bucket.grad)

    def _scatter_async(self, bucket: _Bucket):
        """Post the bucket's reduce-scatter inside the replica; returns its torch Work."""
        if dist.get_backend(bucket.shard_group) == "gloo":
            # Gloo's asynchronous reduce-scatter makes progress only inside wait(); its
            # all-reduce runs on gloo's own threads. This rank's shard receives the same sum
            # (the rest of the bucket too, which the distributed optimizer does not read).
            return dist.all_reduce(bucket.grad, group=bucket.shard_group, async_op=True)
        return dist.reduce_scatter_tensor(bucket.shard, bucket.grad, group=bucket.shard_group,
                                          async_op=True)

    def _post_scattered(self) -> None:
        """Wait for the reduce-scatters in flight and post their buckets' ulfm all-reduces, in
        order."""
        while self._scattering:
            bucket, scatter = self._scattering.pop(0)
            scatter.wait()  # intra-replica: a dead peer makes this raise (the replica gate)
            self._allreduce(bucket)

    def register(self, iteration: int, microbatch_id: int, checksum: int,
                 chunk: int = 0) -> None:
        """(The ledger sink of the pass runner: `interfaces.LedgerSink`.) The schedule consumed
        this microbatch in model chunk `chunk`: its backward accumulates into every bucket of
        this rank (with model chunks, into that chunk's buckets): record it."""
        entry = Entry(iteration, microbatch_id, checksum)
        buckets = (self._buckets.values() if self._chunk_buckets is None
                   else [self._buckets[grad.data_ptr()] for grad in self._chunk_buckets[chunk]])
        for bucket in buckets:
            bucket.ledger.register(entry)

    def sent_ledger(self) -> tuple[Ledger | None, bool]:
        """(What this rank's buckets sent to their latest reductions, whether they all sent the
        same). None when nothing was posted in this pass."""
        sent = [bucket.sent for bucket in self._buckets.values()]
        return sent[0], all(ledger == sent[0] for ledger in sent)

    def reduce_bucket(self, grad: torch.Tensor) -> None:
        """Snapshot `grad`, zero it on a non-contributing replica, reduce-scatter it inside the
        replica when sharded, post the ulfm all-reduce of (this rank's shard of) it."""
        if self._posted_in_pass == 0 and self.before_first_reduce is not None:
            self.before_first_reduce()
        self._posted_in_pass += 1
        bucket = self._state(grad)
        if self.check_finite:
            found = self.nonfinite_norm(grad)
            if found is not None and not self.mode.hold_nonfinite:
                raise NonFiniteResult(f"found {found} in local grad norm for bucket "
                                      f"#{bucket.index} before the cross-replica reduction")
            self.nonfinite = self.nonfinite or found is not None
        if self.mode.fingerprint is not None:
            self.fingerprints[bucket.index] = self.mode.fingerprint(bucket.index, grad)
        bucket.snapshot.copy_(grad)
        bucket.snapshot_ledger = bucket.ledger.copy()
        if not self.mode.contributing or self.nonfinite:
            grad.zero_()
            bucket.ledger.clear()
        bucket.sent = bucket.ledger.copy()
        # From here on `grad` holds the replica's (then the replicas') sum, not this rank's own.
        bucket.ledger = Ledger(known=False)
        self._post(bucket)

    def keep_rerun(self) -> None:
        """A non-finite first pass was rerun finite and is kept: its buckets' snapshots hold
        the rerun's gradient, which this rank contributes from the next round on."""
        self.nonfinite = False

    def any_nonfinite(self) -> bool:
        """Whether some bucket of this rank fails the check now (after a rerun's pass)."""
        return any(self.nonfinite_norm(grad) is not None for grad in self.grads)

    @staticmethod
    def nonfinite_norm(grad: torch.Tensor) -> str | None:
        """Megatron's check of a bucket before its data-parallel reduction: "NaN" or "Inf" when
        the norm of this rank's own gradient is not finite (the rank then raises before
        anything leaves it, or holds it out), None when it is."""
        norm = grad.norm(p=2)
        if torch.isfinite(norm):
            return None
        return "NaN" if torch.isnan(norm) else "Inf"

    def _post(self, bucket: _Bucket) -> None:
        grad = bucket.grad
        if bucket.shard_group is None:
            self._allreduce(bucket)
        elif self._overlapped:
            self._scattering.append((bucket, self._scatter_async(bucket)))
        else:
            # Intra-replica: a dead peer makes this raise and the rank leaves with its replica.
            dist.reduce_scatter_tensor(bucket.shard, grad, group=bucket.shard_group)
            self._allreduce(bucket)

    def _allreduce(self, bucket: _Bucket) -> None:
        """Post the ulfm all-reduce of (this rank's shard of) the bucket."""
        first = not self._allreduced
        bucket.work = self.group.allreduce(bucket.shard)
        self._allreduced = True
        if first and self.after_first_post is not None:
            self.after_first_post()

    def wait(self) -> list[FailureRecord]:
        """Wait for every posted reduction; return the failure records among them."""
        self._post_scattered()
        failures = []
        self.intervals = []
        for bucket in self._buckets.values():
            if bucket.work is None:
                continue
            record = bucket.work.wait()
            bucket.work = None
            self.intervals.append((record.started_s, record.finished_s))
            if record.has_failure:
                bucket.reduced_epoch = None
                failures.append(record)
            else:
                bucket.reduced_epoch = record.epoch
        return failures

    def all_reduced(self) -> bool:
        """Every bucket's latest reduction succeeded, all under the current epoch."""
        epoch = self.group.epoch
        return all(b.reduced_epoch == epoch for b in self._buckets.values())

    @property
    def snapshot_bytes(self) -> int:
        """Memory this rank's snapshots take (one per bucket, the bucket's size)."""
        return sum(b.snapshot.numel() * b.snapshot.element_size() for b in self._buckets.values())

    @property
    def grads(self) -> list[torch.Tensor]:
        return [b.grad for b in self._buckets.values()]

    def snapshots(self) -> list[torch.Tensor]:
        """Each bucket's pre-reduce copy, in reduction order."""
        return [bucket.snapshot for bucket in self._buckets.values()]

    def rewind(self) -> None:
        """Restore every bucket to its pre-reduce contents (the snapshot)."""
        for bucket in self._buckets.values():
            bucket.grad.copy_(bucket.snapshot)
            bucket.ledger = bucket.snapshot_ledger.copy()
            bucket.reduced_epoch = None

    def zero(self) -> None:
        """Empty every bucket, so that a pass accumulates (and syncs) only its own gradients."""
        for bucket in self._buckets.values():
            bucket.grad.zero_()
            bucket.ledger.clear()
            bucket.reduced_epoch = None

    def add_synced_snapshots(self) -> None:
        """After `rewind_under_pass` and the pass: add each synced bucket's pre-reduce contents
        back on top of what the pass accumulated in it (the others were rewound)."""
        for bucket in self._buckets.values():
            if not bucket.synced:
                continue
            bucket.grad.add_(bucket.snapshot)
            bucket.ledger.add(bucket.snapshot_ledger)

    def rewind_under_pass(self) -> None:
        """The non-blocking restore before an extension pass (the paper's): every bucket back to
        its snapshot, so the pass accumulates on top of what this replica already counts.

        With a `restore_stream` (on CUDA) the copies are enqueued on it, after everything the
        current stream did to the buckets, and return at once: they overlap the pass's first
        forward, which does not touch gradients, and `restored()` makes the compute stream wait
        for them before the first backward. Without one (on the CPU, where kernels run in
        program order on this thread anyway) they run here, now.

        A synced bucket is emptied instead, and `add_synced_snapshots()` adds its
        snapshot after the pass: its snapshot holds the replica's synced gradient, and the
        pass's in-replica sync of snapshot plus new gradient would count that part twice.
        """
        stream = self.restore_stream
        if stream is None:
            self._rewind_for_pass()
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._rewind_for_pass()
        self._restore_event = stream.record_event()

    def _rewind_for_pass(self) -> None:
        for bucket in self._buckets.values():
            if bucket.synced:
                bucket.grad.zero_()
                bucket.ledger.clear()
            else:
                bucket.grad.copy_(bucket.snapshot)
                bucket.ledger = bucket.snapshot_ledger.copy()
            bucket.reduced_epoch = None

    def restored(self) -> None:
        """Order a pending side-stream rewind before whatever the current stream does next (a
        wait of the stream, not of this thread); nothing when none is pending. The pass runner
        calls it after each forward (`interfaces.LedgerSink`), the round again before the
        reductions."""
        if self._restore_event is not None:
            torch.cuda.current_stream().wait_event(self._restore_event)
            self._restore_event = None

    def reduce_all(self) -> None:
        """Post every bucket's reduction not yet posted in this pass, in order (after a rewind
        the snapshot is retaken and holds the same contents)."""
        for bucket in list(self._buckets.values()):
            if bucket.sent is None:
                self.reduce_bucket(bucket.grad)
