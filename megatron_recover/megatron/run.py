"""Assemble and run one rank of pretrain_gpt_recover.py from a TrainConfig.

Stock mode (no --recover): Megatron's own data-parallel training on gloo — each data-parallel
rank runs its contiguous slice of the iteration's microbatch ids, DDP averages the gradients.
Recover mode: the cross-replica (data-parallel) group is a `ulfm` group, the bucket reductions go
through layer 2, the policy assigns ids, and `ResilientTrainer` commits each iteration.
Both train the same model on the same microbatch ids, so a failure-free --recover run and a stock
run give the same losses up to floating-point reassociation.
"""

import shutil
import socket
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_recover import collective, runtime
from megatron_recover.faults.schedule import (
    NoFaults,
    ScheduledFaults,
    StandbyFaults,
    load_overflows,
    load_schedule,
    load_slow_snapshot_writes,
    load_standby_entries,
)
from megatron_recover.faults.injection import read_markers, write_marker
from megatron_recover.megatron import mcore_config
from megatron_recover.megatron.audit import LedgerAudit
from megatron_recover.megatron.gpt import (
    MicrobatchPass,
    build_gpt,
    process_groups,
    synced_inside_replica,
    wrap_ddp,
)
from megatron_recover.megatron.progress import Progress
from megatron_recover.megatron.rank_setup import RankSetup
from megatron_recover.megatron.report import RecoverLog
from megatron_recover.megatron.adapter import build_trainer
from megatron_recover.megatron import checkpoint, dist_checkpoint, snapshot, standby
from megatron_recover.megatron import state as training_state
from megatron_recover.recovery import ResilientTrainer
from megatron_recover.policy import (
    ADAPTIVE,
    EXACT,
    RESERVE,
    PolicyConfig,
    PolicyNumMicroBatchesCalculator,
    WorkloadPolicy,
    advance_layout,
)


# Waits that outlive LAST_RESORT_FACTOR x --recover-hang-timeout make a rank leave; a healthy
# long compute of a few times the hang timeout stays far below it.
LAST_RESORT_FACTOR = 10
# Records of committed iterations a rank keeps until it sees them written (recovery log).
PENDING_RECORDS = 1000


def check_start(cfg) -> None:
    """What is not implemented yet stops at start-up, naming the change."""
    if not cfg.recover.enabled:
        dist_checkpoint.check_start(cfg)  # stock --save/--load: megatron-core dist. checkpoints
        return
    if cfg.recover.failure_schedule:
        entries = load_schedule(cfg.recover.failure_schedule, cfg.num_replicas,
                                cfg.parallel.ranks_per_replica, cfg.train_iters,
                                cfg.recover.standby_replicas)
        _check_optimizer_locations(cfg, entries)
        load_standby_entries(cfg.recover.failure_schedule, cfg.recover.standby_replicas)
        if not cfg.recover.standby_replicas and any(e.location == "join-transfer"
                                                    for e in entries):
            raise ValueError(f"{cfg.recover.failure_schedule}: location join-transfer is a "
                             "standby's join; add --recover-standby-replicas")
        overflows = load_overflows(cfg.recover.failure_schedule, cfg.b_at, cfg.train_iters)
        if overflows and not cfg.precision.fp16:
            raise ValueError(f"{cfg.recover.failure_schedule}: forced overflows test fp16's loss "
                             "scaler, which skips the step; without --fp16 the inf gradient "
                             "would reach the parameters: add --fp16 or drop 'overflows'")
        pauses = load_slow_snapshot_writes(cfg.recover.failure_schedule, cfg.train_iters)
        if any(t % max(cfg.recover.snapshot_interval, 1) or not cfg.recover.snapshot_interval
               for t in pauses):
            raise ValueError(f"{cfg.recover.failure_schedule}: slow_snapshot_writes names "
                             "iterations without a snapshot: use multiples of "
                             "--recover-snapshot-interval")


def _check_optimizer_locations(cfg, entries) -> None:
    """A schedule entry inside a collective this job's optimizer step never runs would silently
    not fire."""
    for entry in entries:
        if entry.location == "grad-norm" and cfg.optim.clip_grad <= 0:
            raise ValueError(f"{cfg.recover.failure_schedule}: location grad-norm is the "
                             "--clip-grad norm all-reduce; this job has --clip-grad 0")
        evaluates = cfg.evaluation.due(entry.iteration) or (
            cfg.evaluation.iters > 0 and entry.iteration == cfg.train_iters)
        if entry.location == "evaluation" and not evaluates:
            raise ValueError(f"{cfg.recover.failure_schedule}: location evaluation at iteration "
                             f"{entry.iteration}: no evaluation follows it (--eval-interval "
                             f"{cfg.evaluation.interval}, --eval-iters {cfg.evaluation.iters}, "
                             f"--train-iters {cfg.train_iters})")
        if entry.location == "param-gather" and not cfg.parallel.use_distributed_optimizer:
            raise ValueError(f"{cfg.recover.failure_schedule}: location param-gather is the "
                             "distributed optimizer's parameter all-gather; add "
                             "--use-distributed-optimizer or choose another location")


def _cross_replica_groups(replica_group_ranks: list[int],
                          timeout_s: float) -> tuple[collective.ULFMGroup, dict]:
    """Create the ulfm groups over every data-parallel group (all ranks, same order).

    Returns this rank's group and the map world rank -> replica id (the data-parallel rank).
    """
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(replica_group_ranks))
    mine = None
    for ranks in sorted(set(everyone)):
        group = collective.new_group(list(ranks), timeout_s=timeout_s)
        if group is not None:
            mine = group
    replica_of_rank = {}
    for ranks in set(everyone):
        for dp_rank, world_rank in enumerate(sorted(ranks)):
            replica_of_rank[world_rank] = dp_rank
    return mine, replica_of_rank


def _optimizer_and_scheduler(cfg, ddp_model, pg_collection):
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(mcore_config.to_optimizer_config(cfg), [ddp_model],
                                       use_gloo_process_groups=False, pg_collection=pg_collection)
    scheduler = OptimizerParamScheduler(optimizer, **mcore_config.to_scheduler_kwargs(cfg))
    return optimizer, scheduler


def _stock_step(cfg, ddp_model, optimizer, scheduler, micro_pass, dp_rank, iteration,
                consumed_samples):
    """One iteration of plain Megatron data parallelism over the same ids as the policy's:
    (loss, grad norm, milliseconds, skipped by the fp16 loss scaler?, global batch size).

    As Megatron-LM's training loop, megatron-core's microbatch calculator (installed by
    `train`) is updated with the samples consumed so far and gives the iteration's count. The
    loss is the mean over microbatches or, with --calculate-per-token-loss, the global batch's
    loss sum over its loss tokens, as Megatron-LM reports it."""
    from megatron.core.num_microbatches_calculator import (
        get_current_global_batch_size,
        get_num_microbatches,
        update_num_microbatches,
    )

    update_num_microbatches(consumed_samples, consistency_check=True)
    # Megatron's sampler order: data-parallel rank r's m-th microbatch is slice m * dp + r.
    dp = cfg.data_parallel_size
    ids = [m * dp + dp_rank for m in range(get_num_microbatches())]
    global_batch_size = get_current_global_batch_size()
    start = time.perf_counter()
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    losses, tokens = {}, {}
    micro_pass.run(iteration, ids, losses, tokens)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:  # as Megatron-LM: a step skipped by the fp16 loss scaler keeps the lr
        scheduler.step(increment=global_batch_size)
    total = torch.tensor([sum(losses.values()), sum(tokens.values())], dtype=torch.float64)
    dist.all_reduce(total)
    divisor = (max(total[1].item(), 1) if cfg.model.calculate_per_token_loss
               else global_batch_size // cfg.micro_batch_size)
    return (total[0].item() / divisor, grad_norm,
            (time.perf_counter() - start) * 1e3, not update_successful, global_batch_size)


def microbatch_source(cfg):
    """(MicrobatchSource, tokenizer vocabulary size) for the run's data arguments."""
    from megatron_recover.megatron.data import MicrobatchSource, MicrobatchSourceConfig
    from megatron_recover.megatron.tokenizer import ARGUMENTS, build_tokenizer

    d = cfg.data
    given = {"vocab_file": d.vocab_file, "merge_file": d.merge_file,
             "tokenizer_model": d.tokenizer_model, "vocab_size": d.vocab_size}
    tokenizer = build_tokenizer(d.tokenizer_type,
                                **{k: given[k] for k in ARGUMENTS[d.tokenizer_type]})
    # Reserve mode draws extra ids (B + j): at most one spare per replica and iteration.
    reserve = cfg.train_iters * cfg.b if cfg.recover.mode == RESERVE else 0
    source = MicrobatchSource(MicrobatchSourceConfig(
        tokenizer=tokenizer, sequence_length=cfg.model.seq_length,
        micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.global_batch_size,
        train_iters=cfg.train_iters, train_samples=cfg.train_samples,
        rampup_batch_size=cfg.rampup_batch_size, data_path=d.data_path,
        eval_iters=cfg.evaluation.iters,
        evaluations=cfg.evaluation.evaluations(cfg.train_iters),
        split=d.split, seed=cfg.seed,
        reserve_microbatches=reserve, cache_dir=d.data_cache_path,
        reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss, create_attention_mask=d.create_attention_mask))
    return source, tokenizer.vocab_size


def resumed_policy(cfg, state: checkpoint.RecoveryState, num_replicas: int):
    """(policy, replica id of each data-parallel rank) continuing a checkpoint or snapshot on
    `num_replicas` replicas, keeping B. Original replica ids are reused: the survivors' first."""
    config = mcore_config.to_policy_config(cfg)
    if cfg.b != state.b or config.ramp != state.ramp:
        raise ValueError(f"resuming: the checkpoint or snapshot has B = {state.b} microbatches "
                         f"per iteration (ramp-up {list(state.ramp)}), this run {cfg.b} (ramp-up "
                         f"{list(config.ramp)}): keep --global-batch-size, --micro-batch-size "
                         "and --rampup-batch-size")
    if (cfg.recover.policy, cfg.recover.mode) != (state.policy, state.mode):
        raise ValueError(f"resuming: the checkpoint or snapshot ran --recover-policy "
                         f"{state.policy} --recover-mode {state.mode}; resume with the same")
    if num_replicas > state.w_init:
        raise ValueError(f"resuming: {num_replicas} replicas, but the run started with "
                         f"{state.w_init}; resume with at most that many")
    live = list(state.live_replicas)
    spare_ids = [r for r in range(state.w_init) if r not in live]
    ids = sorted((live + spare_ids)[:num_replicas])
    layout = state.layout
    if ids != sorted(live):
        if state.policy == ADAPTIVE:
            raise ValueError(f"resuming: the adaptive policy resumes on its {len(live)} live "
                             f"replicas only, not {num_replicas}")
        layout = advance_layout(ids, layout.b)
    config = PolicyConfig(w_init=state.w_init, g_init=state.g_init, policy=state.policy,
                          mode=state.mode, ramp=state.ramp)
    return WorkloadPolicy.resume(config, layout, state.iteration, state.reserve_next), ids


def recovery_state(trainer, iteration: int) -> checkpoint.RecoveryState:
    """What the policy needs to continue after `iteration` (checkpoints and snapshots)."""
    policy = trainer.p.policy
    return checkpoint.RecoveryState(
        iteration=iteration, b=policy.config.b, w_init=policy.config.w_init,
        g_init=policy.config.g_init, policy=policy.config.policy, mode=policy.config.mode,
        layout=policy.layout, reserve_next=policy.reserve_next,
        live_replicas=tuple(policy.layout.replicas), ramp=policy.config.ramp)


def save_checkpoint(cfg, trainer, setup: "RankSetup", iteration: int) -> None:
    """The lowest live replica (every rank agrees on it through the policy) writes."""
    if trainer.p.replica != min(trainer.p.policy.layout.replicas):
        return
    state = recovery_state(trainer, iteration)
    checkpoint.save(cfg.checkpoint.save, state, setup.ddp_model, setup.optimizer, setup.scheduler,
                    setup.checkpoint_position, _replica_control_group(cfg, setup),
                    setup.local_rank)


def marker_path(cfg) -> Path:
    """Where victims of the failure schedule leave their markers: beside the recovery log."""
    base = cfg.recover.log or cfg.recover.failure_schedule
    return Path(base).with_suffix(".markers.jsonl")


def save_parameters(model, path: Path) -> None:
    """This rank's final parameters, by name, as CPU tensors (torch.save)."""
    torch.save({name: param.detach().cpu().clone() for name, param in model.named_parameters()},
               path)


def torch_world_id(cfg, ctx: runtime.DistributedContext) -> int:
    """Which torch.distributed world this rank joins (`runtime.init_torch_distributed`): 0 for
    the training ranks, 1 + s for the ranks of standby replica s."""
    if ctx.rank < cfg.parallel.world_size:
        return 0
    return 1 + (ctx.rank - cfg.parallel.world_size) // cfg.parallel.ranks_per_replica


def is_standby(cfg, ctx: runtime.DistributedContext) -> bool:
    return ctx.rank >= cfg.parallel.world_size


def build(cfg, ctx: runtime.DistributedContext, microbatch, vocab_size: int) -> RankSetup:
    """Megatron's parallel state, GPT model, DDP (on ulfm when asked), optimizer and scheduler.
    A standby builds the same over its own replica (its cross-replica group holds only itself
    until it joins)."""
    from megatron.core import parallel_state, tensor_parallel

    hang_s = cfg.recover.hang_timeout_s if cfg.recover.enabled else 0
    par = cfg.parallel
    instances = par.use_distributed_optimizer and par.num_distributed_optimizer_instances > 1
    # A standby instance is alone in its torch world: megatron lays it out as that world's one
    # instance, whose data-parallel group is its shards, as an instance's is in the training
    # world; its DDP config still has the job's instances, so it reduces across them on ulfm.
    standby_instance = instances and is_standby(cfg, ctx)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        num_distributed_optimizer_instances=(1 if standby_instance else
                                             par.num_distributed_optimizer_instances),
        create_gloo_process_groups=False,
        # A last resort for a TP/PP collective stuck on a peer that answers heartbeats but never
        # joins; a failed or frozen peer is handled much sooner by the replica gate.
        distributed_timeout_minutes=LAST_RESORT_FACTOR * hang_s / 60 if hang_s else 30,
    )
    torch.manual_seed(cfg.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    tconfig = mcore_config.to_transformer_config(cfg)
    model = build_gpt(tconfig, mcore_config.padded_vocab_size(cfg, vocab_size),
                      cfg.model.max_position_embeddings, cfg.model.position_embedding_type,
                      share_embeddings=not cfg.model.untie_embeddings_and_output_weights,
                      transformer_impl=cfg.model.transformer_impl)
    if cfg.precision.fp16 or cfg.precision.bf16:
        from megatron.core.transformer.module import Float16Module

        # As Megatron-LM's get_model: fp16/bf16 parameters and compute, fp32 outputs.
        model = Float16Module(tconfig, model)
    # A replica is a data-parallel rank's TP x PP ranks or, with distributed-optimizer instances
    # (Megatron's HSDP form), an instance: its shards reduce-scatter inside it, and only the
    # all-reduce across instances crosses replicas.
    if instances:
        dp_group_ranks = ([dist.get_rank()] if standby_instance else dist.get_process_group_ranks(
            parallel_state.get_inter_distributed_optimizer_instance_group()))
        replica_group = parallel_state.get_intra_distributed_optimizer_instance_group()
        shard_group = parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                             partial_data_parallel=True)
    else:
        dp_group_ranks = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
        replica_group = parallel_state.get_model_parallel_group()
        shard_group = None
    group = replica_of_rank = None
    if cfg.recover.cross_replica_backend == "ulfm":
        # Frozen peers are declared failed by the detector within hang_s; waiting on a slow but
        # live peer is legitimate, so a cross-replica wait leaves only as a last resort.
        group, replica_of_rank = _cross_replica_groups(
            dp_group_ranks, LAST_RESORT_FACTOR * hang_s if hang_s else collective.DEFAULT_TIMEOUT_S)
        runtime.track_group(group)
    if par.ranks_per_replica > 1:
        # MPI ranks: a standby's torch world starts past the training ranks.
        replica_ranks = collective.world_ranks(dist.get_process_group_ranks(replica_group))
        runtime.set_replica_peers(replica_ranks)  # the exit hook asks MPI about them
        if hang_s:
            runtime.start_replica_gate(replica_ranks, hang_s / 4)
    groups = process_groups(group.process_group if group else None, instances)
    ddp_model = wrap_ddp(model, tconfig, mcore_config.to_ddp_config(cfg), groups)
    # With instances the optimizer takes the same groups (a standby instance's megatron state
    # has no group across instances); without, megatron's own, as Megatron-LM builds it.
    optimizer, scheduler = _optimizer_and_scheduler(cfg, ddp_model, groups if instances else None)
    tconfig.grad_scale_func = optimizer.scale_loss
    setup = RankSetup(
        ddp_model=ddp_model, optimizer=optimizer, scheduler=scheduler, micro_pass=None,
        group=group, replica_of_rank=replica_of_rank, replica_group=replica_group,
        shard_group=shard_group, dp_rank=parallel_state.get_data_parallel_rank(),
        replica_index=sorted(dp_group_ranks).index(dist.get_rank()),
        local_rank=dist.get_rank(group=replica_group),
        position=(parallel_state.get_tensor_model_parallel_rank(),
                  parallel_state.get_pipeline_model_parallel_rank()))
    # Exact mode reseeds dropout per microbatch id; stock Megatron draws in sequence, and so does
    # the adaptive/reserve comparison, which does not promise the reference trajectory anyway.
    reseed = cfg.recover.enabled and cfg.recover.mode == EXACT
    faults = _faults(cfg, ctx, setup)
    _optimizer_fault_points(faults, optimizer, ddp_model)
    setup.micro_pass = MicrobatchPass(ddp_model, microbatch, cfg.model.seq_length,
                                      cfg.micro_batch_size, cfg.seed, faults,
                                      reseed_per_microbatch=reseed)
    return setup


def _optimizer_fault_points(faults, optimizer, ddp_model) -> None:
    """Failure-schedule points inside megatron's optimizer step: wrap, on this rank's objects
    only, the call that enters the gradient-norm all-reduce (`clip_grad_norm`, or
    `get_grad_norm` of a chained optimizer) and the distributed optimizer's parameter
    all-gather (`start_param_sync` of the DDP model)."""
    def before(location, method):
        def call(*args, **kwargs):
            faults.at_current(location)
            return method(*args, **kwargs)
        return call

    if faults.wants("grad-norm"):
        for target in [optimizer, *getattr(optimizer, "chained_optimizers", [])]:
            for name in ("clip_grad_norm", "get_grad_norm"):
                setattr(target, name, before("grad-norm", getattr(target, name)))
    if faults.wants("param-gather"):
        ddp_model.start_param_sync = before("param-gather", ddp_model.start_param_sync)


def _faults(cfg, ctx, setup: RankSetup):
    """The failure schedule's points of this rank's replica (a standby's: once it joined)."""
    if not (cfg.recover.enabled and cfg.recover.failure_schedule) or (
            is_standby(cfg, ctx) and setup.group.size == 1):
        return NoFaults()
    entries = load_schedule(cfg.recover.failure_schedule, cfg.num_replicas,
                            cfg.parallel.ranks_per_replica, cfg.train_iters,
                            cfg.recover.standby_replicas)
    # Victims write their markers beside the log: its directory may not exist yet.
    marker_path(cfg).parent.mkdir(parents=True, exist_ok=True)
    if ctx.rank == 0 and cfg.recover.log:
        # The schedule travels with the run's log (reproducible runs).
        shutil.copy(cfg.recover.failure_schedule,
                    Path(cfg.recover.log).with_suffix(".schedule.yaml"))
    return ScheduledFaults(entries, setup.replica_index, setup.local_rank, ctx.rank,
                           marker_path(cfg),
                           load_overflows(cfg.recover.failure_schedule, cfg.b_at, cfg.train_iters))


def _standby_faults(cfg, ctx):
    """A standby's own entries of the failure schedule (before it joins)."""
    if not (cfg.recover.enabled and cfg.recover.failure_schedule):
        return NoFaults()
    marker_path(cfg).parent.mkdir(parents=True, exist_ok=True)
    return StandbyFaults(load_standby_entries(cfg.recover.failure_schedule,
                                              cfg.recover.standby_replicas),
                         torch_world_id(cfg, ctx) - 1, ctx.rank, marker_path(cfg))


def _trainer(cfg, ctx, setup: RankSetup, dataset,
             wants_exit=lambda: False) -> tuple[ResilientTrainer, int]:
    """The resilient trainer of this rank and the first iteration to run (after a --load)."""
    policy = WorkloadPolicy(mcore_config.to_policy_config(cfg))
    replica_ids = list(range(cfg.num_replicas))
    start = 1
    state, source = _resume(cfg, ctx, setup)
    if state is not None:
        policy, replica_ids = resumed_policy(cfg, state, cfg.num_replicas)
        start = state.iteration + 1
        if ctx.rank == 0:
            print(f"megatron-recover: resumed iteration {state.iteration} from "
                  f"{source}: replicas {replica_ids} continue the run's "
                  f"{list(state.live_replicas)}", flush=True)
    # Replica ids are the policy's (original ids when resumed); ranks map through dp rank.
    replica_of_rank = {rank: replica_ids[dp] for rank, dp in setup.replica_of_rank.items()}
    trainer = _resilient_trainer(cfg, setup, dataset, policy, replica_ids[setup.replica_index],
                                 replica_of_rank, wants_exit)
    return trainer, start


def _resume(cfg, ctx, setup: RankSetup) -> tuple[checkpoint.RecoveryState | None, str]:
    """Load the newest state this job left: in-memory snapshots (after a relaunch) unless the
    on-disk checkpoint of --load is newer; (None, "") when there is neither."""
    on_disk = checkpoint.latest_iteration(cfg.checkpoint.load) if cfg.checkpoint.load else None
    start = time.perf_counter()
    if cfg.recover.snapshot_interval:
        state = snapshot.restore(cfg.recover.snapshot_dir, setup.group,
                                 setup.checkpoint_position, setup.ddp_model, setup.optimizer,
                                 setup.scheduler, after=on_disk or 0)
        if state is not None:
            return state, (f"in-memory snapshots in {cfg.recover.snapshot_dir} "
                           f"({time.perf_counter() - start:.3f} s)")
    if on_disk is not None:
        state = checkpoint.load(cfg.checkpoint.load, setup.ddp_model, setup.optimizer,
                                setup.scheduler, setup.checkpoint_position)
        return state, f"{cfg.checkpoint.load} ({time.perf_counter() - start:.3f} s)"
    if cfg.checkpoint.load and ctx.rank == 0:
        # As Megatron-LM: a job script passes the same --load on its first launch.
        print(f"megatron-recover: --load {cfg.checkpoint.load} holds no checkpoint (no "
              f"{checkpoint.TRACKER}): training from scratch", flush=True)
    return None, ""


def _resilient_trainer(cfg, setup: RankSetup, dataset, policy, replica: int,
                       replica_of_rank: dict[int, int], wants_exit) -> ResilientTrainer:
    from megatron.core import parallel_state

    trainer = build_trainer(
        ddp_model=setup.ddp_model, optimizer=setup.optimizer, scheduler=setup.scheduler,
        micro_batch_size=cfg.micro_batch_size, run_pass=setup.micro_pass.run,
        replica_group=_replica_control_group(cfg, setup), shard_group=setup.shard_group,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        synced_inside_replica=frozenset(synced_inside_replica(setup.ddp_model)),
        group=setup.group, policy=policy, per_token_loss=cfg.model.calculate_per_token_loss,
        computes_loss=parallel_state.is_pipeline_last_stage(),
        replica=replica, replica_of_rank=replica_of_rank, faults=setup.micro_pass.faults,
        audit=LedgerAudit(dataset, global_batch_size=cfg.global_batch_size,
                          micro_batch_size=cfg.micro_batch_size, main_samples=cfg.train_samples,
                          policy=cfg.recover.policy, mode=cfg.recover.mode,
                          rampup_batch_size=cfg.rampup_batch_size),
        restore=cfg.recover.restore, wants_exit=wants_exit)
    _install_calculator(cfg, trainer)
    return trainer


def _replica_control_group(cfg, setup: RankSetup):
    """The replica's torch group for the trainer's verdict exchange; None for one-rank replicas."""
    return setup.replica_group if cfg.parallel.ranks_per_replica > 1 else None


def _install_calculator(cfg, trainer: ResilientTrainer) -> None:
    """Make megatron-core's get_num_microbatches() and get_current_global_batch_size() answer
    from this rank's policy (megatron-core has no setter for a calculator of another type)."""
    from megatron.core import num_microbatches_calculator

    shard, shards = trainer.shard
    num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR = (
        PolicyNumMicroBatchesCalculator(trainer.p.policy, trainer.p.replica, cfg.micro_batch_size,
                                        shard, shards))


@dataclass
class Trained:
    """What a rank ends training with (its status file reports the scaler's part)."""

    model: object  # megatron's GPTModel, unwrapped
    loss_scale: float  # the optimizer's final loss scale (1.0 without fp16 scaling)
    skipped_iterations: list[int]  # iterations whose step the fp16 loss scaler skipped
    joined: dict | None = None  # a standby that joined: its join, as it saw it
    snapshots: dict | None = None  # a snapshot writer's seconds per copy and per write


def train(cfg, ctx: runtime.DistributedContext, source, vocab_size: int) -> Trained:
    """Train for cfg.train_iters iterations on `source` (a MicrobatchSource), or until an
    --exit-* flag stops every rank after the same iteration; the lowest live rank prints and
    logs."""
    # Every rank, standbys too, takes part in opening the pool (an MPI world collective).
    pool = (standby.Pool.open(cfg.parallel.world_size, cfg.parallel.ranks_per_replica)
            if cfg.recover.standby_replicas else None)
    setup = build(cfg, ctx, source.microbatch, vocab_size)
    progress = Progress(cfg, ctx, setup, source, vocab_size)
    joined = snapshots = None
    try:
        if cfg.recover.enabled:
            skipped, joined, snapshots = _train_resilient(cfg, ctx, setup, source.dataset,
                                                          progress, pool)
        else:
            skipped = _train_stock(cfg, ctx, setup, progress)
    finally:
        progress.writers.close()
    return Trained(unwrap(setup.ddp_model), float(setup.optimizer.get_loss_scale()), skipped,
                   joined, snapshots)


def _train_stock(cfg, ctx, setup: RankSetup, progress: Progress) -> list[int]:
    """Megatron-LM's loop over plain data parallelism, megatron-core's microbatch calculator
    included; returns the iterations whose step the fp16 loss scaler skipped."""
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    init_num_microbatches_calculator(ctx.rank, cfg.rampup_batch_size, cfg.global_batch_size,
                                     cfg.micro_batch_size, cfg.data_parallel_size)
    skipped = []
    state = (setup.ddp_model, setup.optimizer, setup.scheduler)
    start = dist_checkpoint.load(cfg.checkpoint.load, *state) + 1 if cfg.checkpoint.load else 1
    consumed = cfg.global_batches.first_sample(start)
    iteration = start - 1

    def save():
        _gather_parameters(setup.ddp_model)
        dist_checkpoint.save(cfg.checkpoint.save, iteration, *state)

    for iteration in range(start, cfg.train_iters + 1):
        loss, grad_norm, ms, was_skipped, global_batch_size = _stock_step(
            cfg, setup.ddp_model, setup.optimizer, setup.scheduler, setup.micro_pass,
            setup.dp_rank, iteration, consumed)
        consumed += global_batch_size
        if was_skipped:
            skipped.append(iteration)
        progress.after_iteration(iteration, loss=loss, skipped=was_skipped, iteration_ms=ms,
                                 global_batch_size=global_batch_size, grad_norm=grad_norm)
        if cfg.evaluation.due(iteration):
            progress.evaluate(iteration)
        saved = progress.save_due(iteration)
        if saved:
            save()
        request = False
        if cfg.exit.agreed:  # as Megatron-LM: the maximum over every rank
            flag = torch.tensor([float(progress.exits.requested())])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            request = bool(flag.item() > 0)
        if progress.stopping(iteration, request, saved, save):
            break
    else:
        progress.end_of_training(iteration)
    _gather_parameters(setup.ddp_model)
    return skipped


def _gather_parameters(ddp_model) -> None:
    """With --overlap-param-gather the last step's parameters reach the other shards only in the
    next forward; gather them now, as Megatron-LM does before a save and at the end of training
    (its disable_forward_pre_hook)."""
    if ddp_model.use_forward_hook:
        ddp_model.start_param_sync(force_sync=True)


def unwrap(ddp_model):
    """The GPTModel inside megatron's DDP wrapper (and Float16Module, in fp16/bf16)."""
    from megatron.core.transformer.module import Float16Module

    model = ddp_model.module
    return model.module if isinstance(model, Float16Module) else model


def _train_resilient(cfg, ctx, setup: RankSetup, dataset, progress: Progress,
                     pool: standby.Pool | None) -> tuple[list[int], dict | None, dict | None]:
    """The resilient loop; returns the iterations whose step the fp16 loss scaler skipped, on a
    standby that joined, its join, and on a snapshot writer, its copy and write seconds. A
    standby waits here until it is called; one that is dismissed leaves the run from here."""
    joined = None
    if is_standby(cfg, ctx):
        called = _join_when_called(cfg, ctx, setup, dataset, progress, pool)
        if called is None:  # never returns
            runtime.finish(standby="idle", reason=pool.end_reason, waited_s=pool.waited_s,
                           wait_cpu_s=pool.wait_cpu_s)
        trainer, start, joined = called
    else:
        trainer, start = _trainer(cfg, ctx, setup, dataset, wants_exit=progress.exits.requested)
    progress.trainer = trainer
    # From the first iteration on (not during start-up, a resume or a standby's wait, when a
    # world-wide gloo collective can fail for a peer outside this replica): docs/failures.md.
    runtime.set_program_errors(cfg.recover.program_errors)
    skipped = []
    log = RecoverLog(cfg.recover.log if ctx.rank == 0 else None, last_written=start - 1)
    # Committed iterations whose records this rank has not seen written. Writers can die after a
    # commit and before their record is out, several in a row; whoever writes next writes what
    # the log lacks (bounded: a chain of PENDING_RECORDS writer deaths is not survived in full).
    pending = deque(maxlen=PENDING_RECORDS)
    iteration = start - 1
    snapshots = None
    if cfg.recover.snapshot_interval:
        snapshots = _snapshots(cfg, ctx, setup, trainer)

    def save():
        trainer.gather_parameters()
        save_checkpoint(cfg, trainer, setup, iteration)

    for iteration in range(start, cfg.train_iters + 1):
        lr = setup.optimizer.param_groups[0]["lr"]
        report = trainer.train_step(iteration)
        if joined is not None:  # what this joiner's buckets sent to each commit
            joined["contributions"][iteration] = report.own_contributions
        if report.skipped:
            skipped.append(iteration)
        pending.append((report, dict(lr=lr, tokens=report.contributions * cfg.micro_batch_size
                                     * cfg.model.seq_length)))
        if progress.is_writer():
            if log.path is None and cfg.recover.log:
                log = RecoverLog(cfg.recover.log)  # the writer moved here
            log.write_missing(pending)
            pending.clear()
        recovery_s = sum(e["committed"] - e["detected"] for e in report.events
                         if e["event"] == "failure")
        progress.after_iteration(
            iteration, loss=report.loss, skipped=report.skipped, iteration_ms=report.iteration_ms,
            global_batch_size=report.B * cfg.micro_batch_size, grad_norm=report.grad_norm,
            events=report.events,
            recover={"live replicas": report.live_replicas, "contributions": report.contributions,
                     "B": report.B, "recovery seconds": recovery_s})
        if cfg.evaluation.due(iteration):
            progress.evaluate(iteration)
        saved = progress.save_due(iteration)
        if saved:
            save()
        if snapshots is not None and snapshots.due(iteration, trainer.p.policy.layout.replicas):
            trainer.gather_parameters()
            snapshots.take(iteration, {**training_state.capture(
                setup.ddp_model, setup.optimizer, setup.scheduler),
                "recovery": recovery_state(trainer, iteration)})
        if progress.stopping(iteration, report.exit_requested, saved, save):
            break
        if pool is not None and iteration < cfg.train_iters:
            _grow_back(cfg, trainer, setup, pool, iteration)
    else:
        progress.end_of_training(iteration)
    if pool is not None:
        pool.dismiss()
    stats = None
    if snapshots is not None:
        snapshots.finish()
        stats = {"copy_s": snapshots.copy_s, "write_s": snapshots.write_s}
    trainer.gather_parameters()  # the final parameters, on every shard
    return skipped, joined, stats


def _snapshots(cfg, ctx, setup: RankSetup, trainer: ResilientTrainer) -> snapshot.Snapshots:
    """This rank's snapshot writer, with the failure schedule's slow writes. Collective over
    the training ranks (where each rank is: one copy per node and position is enough)."""
    where = [None] * dist.get_world_size()
    dist.all_gather_object(where, (socket.gethostname(), setup.checkpoint_position))
    replicas_here = sorted(trainer.p.replica_of_rank[rank] for rank, place in enumerate(where)
                           if place == where[dist.get_rank()])
    slow, on_pause = {}, None
    if cfg.recover.failure_schedule is not None:
        markers = marker_path(cfg)
        # A relaunch that redoes an iteration does not pause its write again: once per job.
        paused = {m["iteration"] for m in read_markers(markers)
                  if m.get("location") == "snapshot-write"}
        slow = {t: s for t, s in load_slow_snapshot_writes(cfg.recover.failure_schedule,
                                                           cfg.train_iters).items()
                if t not in paused}

        def on_pause(iteration):
            write_marker(markers, "snapshot-write", ctx.rank,
                         {"location": "snapshot-write", "iteration": iteration})
    return snapshot.Snapshots(cfg.recover.snapshot_dir, cfg.recover.snapshot_interval,
                              setup.checkpoint_position, trainer.p.replica, replicas_here, slow,
                              on_pause)


def state_digests(setup: RankSetup) -> dict:
    """What a joiner must hold exactly as its donor (`state.digests`)."""
    return training_state.digests(unwrap(setup.ddp_model), setup.optimizer)


def _join_state(trainer: ResilientTrainer, setup: RankSetup, iteration: int) -> dict:
    """Everything a joiner needs to continue after `iteration` as a live replica does: the
    complete training state (`state.capture`) and the recovery layer's."""
    trainer.gather_parameters()
    policy = trainer.p.policy
    return {"iteration": iteration, "position": setup.checkpoint_position,
            **training_state.capture(setup.ddp_model, setup.optimizer, setup.scheduler),
            "layout": policy.layout, "last_committed": policy.last_committed,
            "reserve_next": policy.reserve_next, "dead_replicas": sorted(trainer.dead_replicas),
            "replica_of_rank": dict(trainer.p.replica_of_rank),
            "committed_reserve": sorted(trainer.p.audit.committed_reserve),
            "digests": state_digests(setup)}


def _grow_back(cfg, trainer: ResilientTrainer, setup: RankSetup, pool: standby.Pool,
               iteration: int) -> None:
    """(training ranks, after `iteration`) Call idle standbys into the vacant replica ids
    (standby.py, steps 1-4); the outcome is reported with the next iteration."""
    policy = trainer.p.policy
    w_init = policy.config.w_init
    vacant = sorted(set(range(w_init)) - set(policy.layout.replicas))
    if not vacant or not pool.idle:
        return
    event = {"event": "join", "replicas": [], "ranks": [], "called": time.time(),
             "after_iteration": iteration}
    pool.joins += 1
    message = {"join": pool.joins, "iteration": iteration, "idle": list(pool.idle),
               "vacant": vacant}
    pool.send(message)
    assignment, grown, ok, candidates = pool.assemble(message, member=True,
                                                      position=setup.local_rank)
    group, replica_group = setup.group, _replica_control_group(cfg, setup)
    lost = []
    if ok and assignment:
        settled = standby.adopt(group, grown, replica_group, w_init, assignment)
        lost = standby.drop_members(group, settled.dropped)
        ok = bool(settled.joined)
    # Whoever was assigned joined, or left (dropped), or goes back to waiting (not adopted
    # anywhere: `Settled.present` is empty then, on the standbys' side too).
    pool.idle = candidates if not (ok and assignment) else [r for r in candidates
                                                            if r not in assignment]
    if not (ok and assignment):
        _abandon_join(trainer, event, lost)
        return
    blob = training_state.to_bytes(_join_state(trainer, setup, iteration))
    trainer.p.faults.arm_join(group, iteration)
    _, alive, lost_here = standby.transfer(group, assignment, blob)
    lost += lost_here  # since the adoption: every position learns of them in `settle`
    dead = {trainer.p.replica_of_rank[r] for r in lost if r in trainer.p.replica_of_rank}
    settled = standby.settle(replica_group, w_init, assignment, group.members, alive, dead)
    # A survivor lost while a dropped joiner leaves is known at this position only (untested,
    # with M > 1: the other positions learn of its replica at the next iteration's verdict).
    lost += standby.drop_members(group, settled.dropped)
    joined = settled.joined
    failure = trainer.grow(joined, lost, settled.dead)
    if failure is not None:
        trainer.pending_events.append(failure)
    if not joined:
        _abandon_join(trainer, event, lost)
        return
    trainer.pending_events.append({**event, "replicas": sorted(set(joined.values())),
                                   "ranks": sorted(joined), "epoch": setup.group.epoch,
                                   "state_received": time.time()})


def _abandon_join(trainer: ResilientTrainer, event: dict, lost: list[int]) -> None:
    trainer.pending_events.append({**event, "event": "join-abandoned", "lost": lost,
                                   "abandoned": time.time()})


def _join_when_called(cfg, ctx, setup: RankSetup, dataset, progress: Progress,
                      pool: standby.Pool) -> tuple[ResilientTrainer, int, dict] | None:
    """(standby) Wait for a call, join, take the state: (trainer, first iteration to run, the
    join as this rank saw it); None when dismissed or when nobody is left to call."""
    standby_faults = _standby_faults(cfg, ctx)
    standby_faults.idle()
    w_init = cfg.num_replicas
    # The replica's own ranks, to combine the positions' outcomes (standby.settle).
    replica_group = _replica_control_group(cfg, setup)
    group = setup.group
    while True:
        message = pool.wait_for_call()
        if message is None:
            return None
        called = time.time()
        assignment, grown, ok, candidates = pool.assemble(message, member=False,
                                                          position=setup.local_rank)
        pool.idle = [r for r in candidates if r not in assignment]
        if not ok or pool.rank not in assignment:
            continue
        settled = standby.adopt(group, grown, replica_group, w_init, assignment)
        if assignment[pool.rank] not in settled.present:
            pool.idle = candidates  # adopted nowhere: every group is as it was
            continue
        if pool.rank not in settled.joined:  # its group grew at some position, not at all
            runtime.leave("join abandoned: the grown groups did not take at every position")
        lost = standby.drop_members(group, settled.dropped)
        standby_faults.arm_join(group, message["iteration"])
        blob, alive, lost_here = standby.transfer(group, assignment, None)
        lost += lost_here
        break
    state = training_state.from_bytes(blob)
    received = time.time()
    if state["position"] != setup.checkpoint_position:
        raise RuntimeError(f"standby join: the state received is of position "
                           f"{state['position']}, this rank's is {setup.checkpoint_position}")
    dead = {state["replica_of_rank"][r] for r in lost if r in state["replica_of_rank"]}
    settled = standby.settle(replica_group, w_init, assignment, group.members, alive, dead)
    if pool.rank not in settled.joined:
        runtime.leave("join abandoned: the state did not reach every position of this replica")
    lost += standby.drop_members(group, settled.dropped)
    setup.replica_index = assignment[pool.rank]
    training_state.restore(state, setup.ddp_model, setup.optimizer, setup.scheduler)
    faults = _faults(cfg, ctx, setup)  # the schedule's points of the replica id it took
    setup.micro_pass.faults = progress.eval_pass.faults = faults
    _optimizer_fault_points(faults, setup.optimizer, setup.ddp_model)
    policy = WorkloadPolicy.resume(mcore_config.to_policy_config(cfg), state["layout"],
                                   state["last_committed"], state["reserve_next"])
    trainer = _resilient_trainer(cfg, setup, dataset, policy, setup.replica_index,
                                 dict(state["replica_of_rank"]), progress.exits.requested)
    trainer.dead_replicas = set(state["dead_replicas"])
    trainer.p.audit.continue_from(state["committed_reserve"])
    joined = settled.joined
    failure = trainer.grow(joined, lost, settled.dead)
    if failure is not None:
        trainer.pending_events.append(failure)
    event = {"event": "join", "replicas": sorted(set(joined.values())), "ranks": sorted(joined),
             "epoch": setup.group.epoch, "called": called, "state_received": received,
             "after_iteration": state["iteration"]}
    trainer.pending_events.append(dict(event))
    return trainer, state["iteration"] + 1, {**event, "replica": setup.replica_index,
                                             "waited_s": pool.waited_s,
                                             "wait_cpu_s": pool.wait_cpu_s,
                                             "donor_digests": state["digests"],
                                             "digests": state_digests(setup),
                                             "contributions": {}}
