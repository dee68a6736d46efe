"""Megatron-LM's `--ckpt-format torch_dist`: megatron-core distributed checkpoints, for stock
runs and under --recover.

`--save DIR --save-interval N` and `--load DIR` save and resume the way Megatron-LM does, through
`megatron.core.dist_checkpointing`:

  DIR/iter_NNNNNNN/                    one torch_dist checkpoint, written by every rank
  DIR/latest_checkpointed_iteration.txt  the newest complete one (rank 0, after every rank wrote)

A checkpoint holds what Megatron-LM's `generate_state_dict` puts in one: the model's
`sharded_state_dict()`, the optimizer's sharded state over it, the scheduler state, the iteration
and the RNG states (one object per tensor x pipeline position; data-parallel ranks draw alike,
so data-parallel rank 0 writes it), with the common keys of
`checkpoint_common.megatron_common` (its arguments namespace, checkpoint version and FLOPs
counter). In stock runs replicated tensors are spread over the data-parallel ranks for writing
(Megatron-LM's default fully parallel save). The data needs no state: an iteration's
microbatch ids depend only on the iteration number, in both modes.

Under --recover every live rank saves, after any number of failures (`ReplicaWriters`, built by
`RankSetup.checkpoint_writers`), and replicated tensors are spread over the live replicas for
writing as a stock run spreads them over its data-parallel ranks. dist_checkpointing runs every
collective of a save over torch's default group (rank 0 writes the common state, validation and
the planner gather over it), and the torch world may hold dead ranks: for the save a ulfm group
over the live ranks stands in for the world (`_as_world`). It is split from a group made at
start-up over every training rank and repaired by a consensus, since no communicator can be
created over the world while it holds a dead rank. Copies are counted from the lowest live
replica, whose copies become the main ones (`_as_main_replica`). A failure during the save
leaves that checkpoint incomplete and the run going on. When a standby joined (it has a torch
world of its own) the lowest live replica writes alone, over its own training group. The
checkpoint also holds the protocol state (`recover_state`: `ProtocolState.state_dict()`, B,
W_init, the policy layout, ...); a stock run's load ignores it, and a --recover load of a stock
checkpoint starts the policy afresh at its iteration. Distributed-optimizer state is
Megatron-LM's `dp_reshardable` format, so a checkpoint loads on another data-parallel size
(another replica count, or another number of shards).

With --async-save a save returns once its tensors are in host memory; a forked process writes
them, and a later iteration completes the checkpoint (`AsyncSaves`).

As in Megatron-LM, `--load` of a directory without a tracker file starts from scratch (a job
script passes the same `--save`/`--load` on every launch); Megatron-LM's load flags
(`--finetune`, `--no-load-optim`, ...) are resolved in `loading.py`. Rank 0 prints one line per save and
load with its wall-clock span, which scripts/run_restart_baseline.py reads.
"""

import multiprocessing
import pickle
import queue
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_recover.megatron.persistence import common as checkpoint_common, loading
from megatron_recover.megatron.adapters import groups
from megatron_recover.megatron.persistence import training_state

TRACKER = loading.TRACKER
FORMAT_FILE = "metadata.json"  # what dist_checkpointing writes last into a complete checkpoint
RECOVERY_KEY = checkpoint_common.RECOVERY_KEY
# As Megatron-LM passes them: the optimizer's keys follow the model's (no chained prefix), and
# the distributed optimizer's state is saved per bucket, reshardable over the data-parallel size.
_METADATA = {"chained_optim_avoid_prefix": True, "singleton_local_shards": False,
             "distrib_optim_sharding_type": "dp_reshardable"}


def check_start(cfg) -> None:
    """Start-up checks of a stock run's --save/--load (ValueError says what to change)."""
    for directory in (cfg.checkpoint.load, cfg.checkpoint.pretrained_checkpoint):
        if directory:
            check_loadable(directory)


def is_torch_dist(path) -> bool:
    """Whether the checkpoint directory `path` (an iter_NNNNNNN) is a complete torch_dist one."""
    return (Path(path) / FORMAT_FILE).is_file()


def check_loadable(directory) -> None:
    """A tracker in `directory`, if present, must name a torch_dist checkpoint."""
    iteration = loading.tracked_iteration(directory)
    if iteration is None:
        return
    path = loading.iteration_dir(directory, iteration)
    if not is_torch_dist(path):
        raise ValueError(f"--load {directory}: {path} is not a megatron-core distributed "
                         f"(torch_dist) checkpoint (no {FORMAT_FILE}); runs without --recover "
                         "load torch_dist checkpoints (of stock or --recover runs), not the "
                         "--ckpt-format torch files of --recover runs")


def _rng_state():
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = checkpoint_common.rng_state()
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size())
    offset = (parallel_state.get_pipeline_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_rank())
    return ShardedObject("rng_state", [state], shape, offset,
                         replica_id=parallel_state.get_data_parallel_rank())


def _state_dict(chunks, optimizer, scheduler, iteration: int, is_loading: bool,
                optim: bool = True, rng: bool = True) -> dict:
    """What a checkpoint holds (`chunks`: the rank's DDP model chunks, under Megatron-LM's keys
    "model" or "model0", "model1", ...); for a load, the parts to read (`optim`: the optimizer
    and the scheduler; `rng`: the generators)."""
    models = {key: chunk.module.sharded_state_dict()
              for key, chunk in zip(training_state.model_keys(chunks), chunks)}
    state = {**models, "iteration": iteration}
    if optim:
        training_state.initialize_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            models["model"] if len(models) == 1 else models, is_loading=is_loading,
            metadata=_METADATA)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if rng:
        state["rng_state"] = _rng_state()
    return state


@dataclass(frozen=True)
class ReplicaWriters:
    """Who writes a --recover torch_dist checkpoint, and how its copies are counted
    (`RankSetup.checkpoint_writers` builds it).

    group: the ranks that save, standing in for the world: every live rank (their ulfm
        group), or, when a standby joined (it has a torch world of its own), the lowest live
        replica's training group alone.
    offset: megatron's data-parallel rank of this replica's first rank; subtracted, it leaves
        the shard's index in its replica.
    distance: this replica's distance from the lowest live one. Copies are counted from the
        lowest live replica, whose copies become the main ones (replica id 0): the
        distributed optimizer counts them by instance, the rest by data-parallel rank
        (`distance` x `shards` + shard).
    shards: distributed-optimizer shards per replica (1 without).
    experts: the expert-parallel size: megatron counts an expert tensor's copies by expert
        data-parallel rank, `shards` / `experts` of them per replica.
    spread: the group over which replicated tensors are spread for writing (this position's
        live copies, one per live replica), as megatron's fully parallel save spreads them
        over the data-parallel ranks; None when the lowest live replica writes alone.
    agree: where the writers agree that an --async-save's processes all ended.
    """

    group: object
    offset: int
    distance: int = 0
    shards: int = 1
    experts: int = 1
    spread: object = None
    agree: object = None


def _as_main_replica(state: dict, writers: ReplicaWriters) -> None:
    """Count each copy from the lowest live replica, whose copies become the main ones (replica
    id 0 along the data-parallel axis): megatron writes each tensor once, from the rank whose
    copy has replica id 0, and counts copies by megatron's data-parallel rank, in which the
    lowest live replica is not necessarily the first. The distributed optimizer's state counts
    its copies by instance (the first coordinate), an expert tensor by expert data-parallel rank
    (the last), the rest by data-parallel rank (the last; an int for the RNG objects).
    megatron's own validation of the save checks that each tensor then has exactly one main
    copy."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory

    shift = writers.distance * writers.shards - writers.offset
    # An expert-parallel group of E ranks lies inside a replica: S / E expert copies per replica.
    expert_shift = (writers.distance * writers.shards - writers.offset) // writers.experts
    for value in nested_values(state):
        if not isinstance(value, (ShardedBase, ShardedTensorFactory)):
            continue
        replica_id = value.replica_id
        if isinstance(replica_id, int):
            value.replica_id = replica_id + shift
        elif "optimizer.distributed." in value.key:  # with a chained_N. prefix too
            value.replica_id = (writers.distance, *replica_id[1:])
        elif ".experts." in value.key:  # not a shared expert's (".shared_experts.")
            value.replica_id = (*replica_id[:-1], replica_id[-1] + expert_shift)
        else:
            value.replica_id = (*replica_id[:-1], replica_id[-1] + shift)


def _fresh_results_queue(forked: bool):
    """Give megatron's checkpoint writer a new queue for this save's write results, and return
    it. By default it keeps one multiprocessing Manager (a spawned server process) for them. A
    Manager outlives a rank killed by a signal and keeps the rank's stdout open, so mpirun
    would wait for it forever after a failure that followed a save (measured: a --recover run
    whose writer died inside a save never ended). A synchronous save puts and takes its results
    in the saving process (a plain queue); an asynchronous one takes them from its forked
    writer (`_ForkedResults`)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = _ForkedResults() if forked else queue.Queue()
    return filesystem_async._results_queue


class _ForkedResults:
    """The write results of an asynchronous save: megatron's writer, in the forked process,
    puts them once; the saving process takes them when it completes the save. `drain` takes
    them as soon as they arrive, so that a large result never leaves the writer blocked on a
    full pipe while the saving process waits for the writer to end."""

    TAKE_TIMEOUT_S = 60.0  # after the writer ended (or, blocking, while it finishes)

    def __init__(self):
        self._queue = multiprocessing.get_context("fork").Queue()
        self._taken = []

    def put(self, item) -> None:  # in the writer process
        self._queue.put(item)

    def drain(self) -> None:
        try:
            self._taken.append(self._queue.get_nowait())
        except queue.Empty:
            pass

    def get_nowait(self):
        """The results (megatron's writer calls it when the save completes); queue.Empty, which
        megatron reports as a failed write, when the writer ended without any."""
        if not self._taken:
            self._taken.append(self._queue.get(timeout=self.TAKE_TIMEOUT_S))
        return self._taken.pop(0)


@contextmanager
def _as_world(group, inside=None):
    """Inside, `group` is torch.distributed's world: the default group, with its own ranks as
    the global ones (dist_checkpointing saves over the default group only, and maps its ranks
    to global ones; see the module docstring). `inside`, a group of some of its members, is
    mapped from those ranks too; nothing inside may use another group."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    default, ranks = world.default_pg, world.pg_group_ranks[group]
    saved = {other: world.pg_group_ranks[other] for other in (inside,) if other is not None}
    world.default_pg = group
    world.pg_group_ranks[group] = {rank: rank for rank in range(group.size())}
    for other, other_ranks in saved.items():
        world.pg_group_ranks[other] = {ranks[g]: r for g, r in other_ranks.items()}
    try:
        yield
    finally:
        world.pg_group_ranks.update(saved)
        world.pg_group_ranks[group] = ranks
        world.default_pg = default


@dataclass
class _InFlight:
    process: object  # the forked writer, or None when this rank has nothing to write
    results: _ForkedResults
    complete: object  # completes the checkpoint: megatron's finalization, then the tracker
    agree: object  # where the writers agree that they all ended (None: this rank alone)

    def wait(self) -> None:
        """Until the writer ended, taking its results as they come (`_ForkedResults.drain`)."""
        while self.process is not None and self.process.is_alive():
            self.results.drain()
            self.process.join(timeout=0.05)


class AsyncSaves:
    """--async-save, with Megatron-LM's meaning: `save` returns once this rank's tensors are
    copied to host memory, a forked process writes them while training goes on, and the
    checkpoint is completed (megatron's metadata, then the tracker) at a later `poll` once
    every writer's process has ended. Until then the tracker names the previous checkpoint, so
    a writer that dies first leaves it the newest. One save is in flight at a time: the next
    save, and the end of training, wait for it (`poll(blocking=True)`).

    Megatron-core's own asynchronous caller is CUDA-only (it synchronizes the device and
    agrees over the default group with CUDA tensors); this one agrees over the group the save
    names (gloo, the world's, in stock runs; under --recover the savers' ulfm group, or the
    writing replica's gloo control group; None for a replica of one rank). The host copy is `to("cpu")`, a blocking copy from the device; a CPU tensor's
    is the tensor itself, and the writer, forked right after, holds the process's memory as it
    was then (copy-on-write), whatever the next optimizer step changes."""

    def __init__(self):
        self.in_flight: _InFlight | None = None

    def start(self, request, results: _ForkedResults, complete, agree) -> None:
        args = list(request.async_fn_args)
        process = None
        if request.async_fn is not None:  # megatron's writer: (rank, write buckets, results)
            args[1] = [(path, key, (data, [(item, tensor.detach().to("cpu"))
                                           for item, tensor in tensors]))
                       for path, key, (data, tensors) in args[1]]
            process = multiprocessing.get_context("fork").Process(
                target=request.async_fn, args=args, kwargs=request.async_fn_kwargs)
            process.start()
        self.in_flight = _InFlight(process, results, lambda: complete(request), agree)

    def abandon(self) -> None:
        """Leave the save in flight incomplete once its writer ended (its files are on disk,
        megatron's metadata is not, and the tracker does not name it): under --recover, when
        this replica is no longer the lowest live one, whose newer save supersedes it;
        completing it could move the tracker back after that one."""
        flight, self.in_flight = self.in_flight, None
        if flight is not None:
            flight.wait()

    def poll(self, blocking: bool = False) -> None:
        """Complete the save in flight if every writer's process has ended (`blocking`: once
        they have). Every rank that started it calls this at the same points."""
        flight = self.in_flight
        if flight is None:
            return
        if not blocking:
            flight.results.drain()
            running = torch.tensor([int(flight.process is not None
                                        and flight.process.is_alive())])
            if flight.agree is not None:
                dist.all_reduce(running, group=flight.agree)  # a sum: ulfm sums only
            if running.item():
                return
        flight.wait()  # blocking
        self.in_flight = None
        if flight.process is not None and flight.process.exitcode != 0:
            raise RuntimeError(f"--async-save: the checkpoint writer process ended with exit "
                               f"code {flight.process.exitcode}; the checkpoint is incomplete "
                               "and the tracker names the previous one")
        flight.complete()


def _report(message: str, start: float, end: float) -> None:
    if dist.get_rank() == 0:
        print(f"  {message} [ {end - start:.3f} s, wall {start:.3f} -> {end:.3f} ]", flush=True)


def save(directory, iteration: int, chunks, optimizer, scheduler, common: dict,
         recovery: dict | None = None, writers: ReplicaWriters | None = None,
         written=lambda: None, saves: AsyncSaves | None = None) -> None:
    """Write iteration `iteration`'s checkpoint, with the `common` keys
    (`checkpoint_common.megatron_common`). Stock runs: every rank calls. --recover: the ranks
    of `writers` call, with the `recovery` state (`ProtocolState.state_dict()`). All return once it is complete and the
    tracker names it; until then the tracker names the previous one. `written()` is called on
    each writer once its part is on disk, before the tracker moves. With `saves`
    (--async-save) they return once their tensors are in host memory, and a later
    `saves.poll` completes the checkpoint."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    start = time.time()
    if saves is not None:
        saves.poll(blocking=True)  # one save in flight at a time
    results = _fresh_results_queue(forked=saves is not None)
    path = loading.iteration_dir(directory, iteration)
    path.mkdir(parents=True, exist_ok=True)
    state = {**common, **_state_dict(chunks, optimizer, scheduler, iteration, False)}
    if writers is None:
        world, agree = nullcontext, groups.world_control()
        strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy("torch_dist"),
            parallel_state.get_data_parallel_group())
    else:
        state[RECOVERY_KEY] = recovery
        _as_main_replica(state, writers)
        world, agree = (lambda: _as_world(writers.group, writers.spread)), writers.agree
        strategy = None if writers.spread is None else FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy("torch_dist"), writers.spread)

    def complete(request=None):
        with world():
            if request is not None:
                for finalize in request.finalize_fns:  # megatron's metadata
                    finalize()
            written()
            _commit(directory, iteration, start)

    with world():
        # megatron-core's own asynchronous writer ("mcore"), not its default since 0.19
        # (NVIDIA Resiliency Extension's, a package we do not install): `AsyncSaves` runs the
        # request's writer and reads its results queue.
        request = dist_checkpointing.save(state, str(path), sharded_strategy=strategy,
                                          async_sharded_save=saves is not None,
                                          async_strategy="mcore")
        if saves is not None:
            saves.start(request, results, complete, agree)
            _report(f"scheduled an async checkpoint save at iteration {iteration:7d} to "
                    f"{directory}", start, time.time())
    if saves is None:
        complete()


def _commit(directory, iteration: int, start: float) -> None:
    """Name the checkpoint in the tracker once every writer's shards are on disk."""
    dist.barrier()
    if dist.get_rank() == 0:
        tracker = Path(directory) / TRACKER
        tracker.with_suffix(".tmp").write_text(f"{iteration}\n")
        tracker.with_suffix(".tmp").replace(tracker)
    _report(f"successfully saved checkpoint from iteration {iteration:7d} to {directory}",
            start, time.time())


def nothing_to_load(directory, start: float) -> None:
    """Say that `directory` holds no checkpoint yet (the run starts from scratch)."""
    _report(f"no checkpoint in {directory}: training starts from iteration 1", start,
            time.time())


def _model_parallel_mismatch(path: Path) -> str | None:
    """What differs when the checkpoint in `path` was written with other (TP, PP) sizes than
    this run's (its RNG object is laid out by them), in Megatron-LM's words; None if nothing."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    # The RNG object's shards are keyed rng_state/shard_<offset>_<global shape>.
    saved = next((tuple(value.global_shape) for key, value in
                  load_sharded_metadata(str(path)).items() if key.startswith("rng_state/")), None)
    run = (parallel_state.get_pipeline_model_parallel_world_size(),
           parallel_state.get_tensor_model_parallel_world_size())
    if saved is None or saved == run:
        return None
    return f"(TP, PP) mismatch after resume ({run[::-1]} vs {saved[::-1]} from checkpoint)"


def _unreadable(error: Exception) -> str | None:
    """What went wrong when `error`, raised by a load, says that a file of the checkpoint could
    not be read (missing, truncated, not a torch file), on this rank or on any rank torch's
    CheckpointException gathered it from; None when it is about what the files hold."""
    causes = [error, error.__cause__, error.__context__,
              *(failure[0] if isinstance(failure, tuple) else failure
                for failure in getattr(error, "failures", {}).values())]
    for cause in causes:
        if isinstance(cause, (OSError, EOFError, pickle.UnpicklingError)) or (
                isinstance(cause, RuntimeError) and "PytorchStreamReader" in str(cause)):
            return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    return None


def load(plan, chunks, optimizer, scheduler, cfg) -> tuple[int, dict | None]:
    """Load what `plan` (loading.LoadPlan) names into the model and, as it says, the
    optimizer, scheduler and RNGs; every rank calls, inside run._agreed_start (a rank that
    cannot read its files raises alone). Returns the iteration the run continues
    after (the checkpoint's, or 0 for a fine-tune) and the checkpoint's --recover state (None
    when a stock run wrote it)."""
    from megatron.core import dist_checkpointing

    start = time.time()
    path = plan.path
    if not is_torch_dist(path):
        raise ValueError(f"--load: {path} is not a complete megatron-core distributed "
                         f"(torch_dist) checkpoint (no {FORMAT_FILE})")
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint import CheckpointException  # torch's, gathered from ranks

    # As Megatron-LM: the model and a plain optimizer's state are resharded to other TP and PP
    # sizes; the generators (one per position) are not loaded then, and the distributed
    # optimizer's per-bucket state loads only at the sizes it was written with.
    mismatch = _model_parallel_mismatch(path)
    if mismatch and plan.optimizer and training_state.distributed_optimizers(optimizer):
        raise ValueError(f"--load: {path}: {mismatch}: the distributed optimizer's state "
                         "(dp_reshardable) loads only with the tensor- and pipeline-parallel "
                         "sizes it was written with: load with those, or with --no-load-optim")
    if mismatch and plan.rng and dist.get_rank() == 0:
        print(f"megatron-recover: {mismatch}: RNG state will be ignored", flush=True)
    rng = plan.rng and not mismatch
    template = _state_dict(chunks, optimizer, scheduler, plan.iteration, True,
                           optim=plan.optimizer, rng=rng)
    try:
        state = dist_checkpointing.load(template, str(path))
        for key, chunk in zip(training_state.model_keys(chunks), chunks):
            chunk.module.load_state_dict(state[key])
    except (CheckpointingException, CheckpointException, RuntimeError, OSError, EOFError,
            pickle.UnpicklingError) as error:  # shapes and keys, or files that cannot be read
        torn = _unreadable(error)
        if torn:
            raise ValueError(f"--load: {path} cannot be read ({torn}); a torn or partial "
                             "checkpoint? Load an earlier one (--ckpt-step)") from error
        raise ValueError(loading.model_mismatch(path, error)) from error
    if plan.optimizer:
        with torch.no_grad():  # fp32 distributed-optimizer main parameters are model views
            loading.load_optimizer_state(optimizer, state["optimizer"], path)
        training_state.restore_steps(optimizer)
        scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()  # fp16/bf16 main parameters from the loaded model
    if rng:
        checkpoint_common.restore_rng_state(state["rng_state"][0])
    if state["iteration"] != plan.iteration:
        raise ValueError(f"--load: {path} holds iteration {state['iteration']}, not "
                         f"{plan.iteration}")
    if plan.resumes and "args" in state:
        checkpoint_common.check_data_position(state["args"], plan.iteration, cfg)
    # No collective here: megatron-core 0.19 reads with torch's checkpoint reader per rank
    # (no_dist), so a torn file fails only the ranks that read it, which raise; the caller's
    # agreement (run._agreed_start), which every rank reaches either way, stops them all.
    _report(f"successfully loaded checkpoint from {plan.directory} at iteration "
            f"{plan.iteration:7d}" + ("" if plan.resumes else " (fine-tuning from iteration 1)"),
            start, time.time())
    return (plan.iteration if plan.resumes else 0), state.get(RECOVERY_KEY)

