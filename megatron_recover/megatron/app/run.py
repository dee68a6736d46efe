"""Assemble one rank of pretrain_gpt_recover.py from a TrainConfig and run it: the start-up
checks of the failure schedule, megatron's parallel state, GPT model, DDP, optimizer and
scheduler (`build`), the failure schedule's points, the trainer, and the loop (loop.py) over the
stepper of the run's mode.

Stock mode (no --recover): Megatron's own data-parallel training on gloo. Recover mode: the
cross-replica (data-parallel) group is a `ulfm` group, the bucket reductions go through layer 2,
the policy assigns ids, and `ResilientTrainer` commits each iteration. Both train the same model
on the same microbatch ids, so a failure-free --recover run and a stock run give the same losses
up to floating-point reassociation.
"""

import dataclasses
import functools
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_recover import collective, runtime
from megatron_recover.faults.injection import read_markers, write_marker
from megatron_recover.faults.schedule import (
    FailureSchedule,
    NoFaults,
    ScheduledFaults,
    StandbyFaults,
)
from megatron_recover.hang import LAST_RESORT_FACTOR
from megatron_recover.megatron.persistence import snapshots as snapshot
from megatron_recover.megatron.persistence import torch_dist as dist_checkpoint
from megatron_recover.megatron.adapters import groups, moe_losses
from megatron_recover.megatron.app import joins, resume
from megatron_recover.megatron.config import mcore_config
from megatron_recover.recovery.membership import standby
from megatron_recover.megatron.persistence import training_state
from megatron_recover.megatron.adapters.trainer_parts import bucket_kinds, build_trainer
from megatron_recover.megatron.data.audit import DatasetAudit
from megatron_recover.megatron.adapters.gpt import (
    MicrobatchPass,
    build_model_chunks,
    process_groups,
    seed_stage,
    synced_inside_replica,
    wrap_ddp,
)
from megatron_recover.megatron.app.loop import ResilientStepper, StockStepper, run_loop
from megatron_recover.megatron.app.progress import ExitRequests, Progress
from megatron_recover.megatron.app.rank_setup import RankSetup
from megatron_recover.policy import (
    EXACT,
    RESERVE,
    PolicyNumMicroBatchesCalculator,
)
from megatron_recover.recovery import ResilientTrainer
from megatron_recover.recovery.protocol_state import ProtocolState, resume_policy
from megatron_recover.recovery.verification import Verification


def check_start(cfg) -> FailureSchedule | None:
    """What is not implemented yet stops at start-up, naming the change. Returns the run's
    failure schedule, read and checked against the job here once (None without one)."""
    if not cfg.recover.enabled:
        dist_checkpoint.check_start(cfg)  # stock --save/--load: megatron-core dist. checkpoints
        return None
    if not cfg.recover.failure_schedule:
        return None
    schedule = FailureSchedule.load(cfg.recover.failure_schedule, cfg.num_replicas,
                                    cfg.parallel.ranks_per_replica, cfg.train_iters, cfg.b_at,
                                    cfg.recover.standby_replicas)
    _check_optimizer_locations(cfg, schedule.entries)
    if not cfg.recover.standby_replicas and any(e.location == "join-transfer"
                                                for e in schedule.entries):
        raise ValueError(f"{cfg.recover.failure_schedule}: location join-transfer is a "
                         "standby's join; add --recover-standby-replicas")
    if schedule.overflows and not cfg.precision.fp16:
        raise ValueError(f"{cfg.recover.failure_schedule}: forced overflows test fp16's loss "
                         "scaler, which skips the step; without --fp16 the inf gradient "
                         "would reach the parameters: add --fp16 or drop 'overflows'")
    if schedule.bad_samples and not cfg.precision.check_for_nan_in_loss_and_grad:
        raise ValueError(f"{cfg.recover.failure_schedule}: bad_samples test Megatron's NaN "
                         "check, which this job runs without (fp16 with dynamic loss "
                         "scaling, or --no-check-for-nan-in-loss-and-grad): drop them")
    if any(t % max(cfg.recover.snapshot_interval, 1) or not cfg.recover.snapshot_interval
           for t in schedule.slow_snapshot_writes):
        raise ValueError(f"{cfg.recover.failure_schedule}: slow_snapshot_writes names "
                         "iterations without a snapshot: use multiples of "
                         "--recover-snapshot-interval")
    return schedule


def _check_optimizer_locations(cfg, entries) -> None:
    """A schedule entry at a point this job never reaches (a collective its optimizer step never
    runs, an evaluation or a save that never follows) would silently not fire."""
    for entry in entries:
        reason = _unreached(cfg, entry.location, entry.iteration)
        if reason:
            raise ValueError(f"{cfg.recover.failure_schedule}: {reason}")


def _unreached(cfg, location: str, iteration: int) -> str | None:
    """Why this job never reaches `location` of `iteration`, or None."""
    if location == "grad-norm" and cfg.optim.clip_grad <= 0:
        return "location grad-norm is the --clip-grad norm all-reduce; this job has --clip-grad 0"
    if location == "evaluation" and not (cfg.evaluation.due(iteration) or (
            cfg.evaluation.iters > 0 and iteration == cfg.train_iters)):
        return (f"location evaluation at iteration {iteration}: no evaluation follows it "
                f"(--eval-interval {cfg.evaluation.interval or 0}, --eval-iters "
                f"{cfg.evaluation.iters}, --train-iters {cfg.train_iters})")
    if location == "checkpoint-save" and not (cfg.checkpoint.due(iteration, cfg.train_iters) or (
            cfg.checkpoint.save and iteration == cfg.exit.interval)):  # its stop saves
        return (f"location checkpoint-save at iteration {iteration}: no save follows it (--save "
                f"{cfg.checkpoint.save}, --save-interval {cfg.checkpoint.save_interval}, "
                f"--exit-interval {cfg.exit.interval}, --train-iters {cfg.train_iters})")
    if location == "param-gather" and not cfg.parallel.use_distributed_optimizer:
        return ("location param-gather is the distributed optimizer's parameter all-gather; add "
                "--use-distributed-optimizer or choose another location")
    return None


def _cross_replica_groups(replica_group_ranks: list[int],
                          timeout_s: float) -> tuple[collective.ULFMGroup, dict]:
    """Create the ulfm groups over every data-parallel group (all ranks, same order).

    Returns this rank's group and the map world rank -> replica id (the data-parallel rank).
    """
    distinct = groups.every_group(replica_group_ranks)
    mine = None
    for ranks in distinct:
        group = collective.new_group(list(ranks), timeout_s=timeout_s)
        if group is not None:
            mine = group
    replica_of_rank = {}
    for ranks in distinct:
        for dp_rank, world_rank in enumerate(sorted(ranks)):
            replica_of_rank[world_rank] = dp_rank
    return mine, replica_of_rank


def _torch_plane(control: collective.ULFMGroup, ctx: runtime.DistributedContext, cuda: bool,
                 timeout_s: float, hang_s: float) -> collective.TorchPlaneGroup:
    """The cross-replica group's data operations on a reconfigurable torch group (NCCL on CUDA,
    gloo on the CPU), `control` its control plane. A rebuild's rendezvous is bounded by the hang
    timeout: a member that does not show up within it is dead or frozen."""
    options = collective.PlaneOptions(
        device="cuda" if cuda else "cpu", address=runtime.own_address(),
        stable_rank=ctx.rank, stable_size=ctx.world_size, timeout_s=timeout_s,
        reconfigure_timeout_s=hang_s or collective.DEFAULT_TIMEOUT_S)
    group = collective.TorchPlaneGroup(control, options)
    if ctx.rank == 0:
        print(f"megatron-recover: cross-replica data plane: torch ({group.backend}, "
              "reconfigured over the survivors); control plane: ulfm", flush=True)
    return group


def _check_experts_inside(replica_group) -> None:
    """Every expert-parallel group megatron made lies inside this rank's replica (arguments.py
    chose the layout so; a failure must take a layer's experts down together)."""
    from megatron.core import parallel_state

    replica = set(dist.get_process_group_ranks(replica_group))
    experts = set(dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()))
    if not experts <= replica:
        raise RuntimeError(f"expert-parallel group {sorted(experts)} spans replicas (this "
                           f"replica: {sorted(replica)})")


def _agreed_start(start, finalize: bool = False):
    """Run `start()` (the checkpoint load) on every rank, then agree on the outcome: when it
    raised ValueError (what --load names is missing or does not fit) on any rank, every rank
    stops with the first such message, so no rank trains on while another left. A file that
    only some ranks read (a torn position file) fails on those ranks alone."""
    try:
        result, message = start(), None
    except ValueError as error:
        result, message = None, str(error)
    messages = [None] * dist.get_world_size(groups.world_control())
    dist.all_gather_object(messages, message, group=groups.world_control())
    first = next((m for m in messages if m is not None), None)
    if first is not None:
        runtime.stop_at_startup(first, finalize=finalize)
    return result


def _optimizer_and_scheduler(cfg, ddp_chunks, pg_collection):
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(mcore_config.to_optimizer_config(cfg), list(ddp_chunks),
                                       use_gloo_process_groups=False, pg_collection=pg_collection)
    scheduler = OptimizerParamScheduler(optimizer, **mcore_config.to_scheduler_kwargs(cfg))
    return optimizer, scheduler


def microbatch_source(cfg):
    """(MicrobatchSource, the model's unpadded vocabulary size) for the run's data arguments."""
    from megatron_recover.megatron.data.datasets import MicrobatchSource, MicrobatchSourceConfig
    from megatron_recover.megatron.data.tokenizers import build_arguments, build_tokenizer

    d = cfg.data
    given = {"vocab_file": d.vocab_file, "merge_file": d.merge_file,
             "tokenizer_model": d.tokenizer_model, "vocab_size": d.vocab_size,
             "tiktoken_pattern": d.tiktoken_pattern,
             "tiktoken_num_special_tokens": d.tiktoken_num_special_tokens,
             "tokenizer_special_tokens": d.tokenizer_special_tokens,
             "null_tokenizer_eod_id": d.null_tokenizer_eod_id,
             "null_tokenizer_pad_id": d.null_tokenizer_pad_id}
    tokenizer = build_tokenizer(d.tokenizer_type, **build_arguments(d.tokenizer_type, given))
    # Reserve mode draws extra ids (B + j): at most one spare per replica and iteration.
    reserve = cfg.train_iters * cfg.b if cfg.recover.mode == RESERVE else 0
    source = MicrobatchSource(MicrobatchSourceConfig(
        tokenizer=tokenizer, sequence_length=cfg.model.seq_length,
        micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.global_batch_size,
        train_iters=cfg.train_iters, train_samples=cfg.train_samples,
        step_batch_size_schedule=cfg.step_batch_size_schedule,
        eval_global_batch_size=cfg.eval_global_batch_size,
        blend=d.blend, blend_per_split=d.blend_per_split,
        eval_iters=cfg.evaluation.iters,
        evaluations=cfg.evaluation.evaluations(cfg.train_iters),
        split=d.split, seed=cfg.seed,
        reserve_microbatches=reserve, cache_dir=d.data_cache_path,
        reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss, create_attention_mask=d.create_attention_mask,
        mmap_bin_files=d.mmap_bin_files))
    # The model's vocabulary is the tokenizer's, for every type (Megatron-LM core_v0.19.0).
    return source, tokenizer.vocab_size


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


def build(cfg, ctx: runtime.DistributedContext, vocab_size: int, model_provider) -> RankSetup:
    """Megatron's parallel state, the model of `model_provider` (the entry's seam), DDP (on
    ulfm when asked), optimizer and scheduler. A standby builds the same over its own replica
    (its cross-replica group holds only itself until it joins)."""
    from megatron.core import parallel_state

    groups.world_control()  # created now, at start-up, by every rank (groups.py)
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
        expert_model_parallel_size=par.expert_model_parallel_size,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_stages,
        num_distributed_optimizer_instances=(1 if standby_instance else
                                             par.num_distributed_optimizer_instances),
        create_gloo_process_groups=False,
        # A last resort for a TP/PP collective stuck on a peer that answers heartbeats but never
        # joins; a failed or frozen peer is handled much sooner by the replica gate.
        distributed_timeout_minutes=LAST_RESORT_FACTOR * hang_s / 60 if hang_s else 30,
    )
    seed_stage(cfg.seed)
    tconfig = mcore_config.to_transformer_config(cfg)
    if tconfig.overlap_p2p_comm and dist.get_backend(
            parallel_state.get_pipeline_model_parallel_group()) == "gloo":
        # The interleaved schedule frees a sent activation's storage before it waits for the
        # send; gloo's send reads that storage on its own thread (NCCL's records its stream on
        # it), and the receiver got garbage or NaN: on gloo the activations are kept.
        tconfig.deallocate_pipeline_outputs = False
    chunks = build_model_chunks(model_provider, cfg, tconfig,
                                mcore_config.padded_vocab_size(cfg, vocab_size))
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
    if cfg.recover.enabled and par.expert_model_parallel_size > 1:
        _check_experts_inside(replica_group)
    group = replica_of_rank = saving_group = None
    if cfg.recover.cross_replica_backend == "ulfm":
        if (cfg.recover.enabled and cfg.checkpoint.save
                and cfg.checkpoint.ckpt_format == "torch_dist"):
            # Every training rank: a torch_dist save's groups are split from it (rank_setup).
            # (a duplicate of the torch world's MPI communicator: MPI_Comm_create_group over
            # every rank was measured to hang with pipeline parallelism).
            saving_group = collective.new_group(list(range(dist.get_world_size())),
                                                duplicate=runtime.torch_world_comm())
        # Frozen peers are declared failed by the detector within hang_s; waiting on a slow but
        # live peer is legitimate, so a cross-replica wait leaves only as a last resort.
        timeout_s = LAST_RESORT_FACTOR * hang_s if hang_s else collective.DEFAULT_TIMEOUT_S
        group, replica_of_rank = _cross_replica_groups(dp_group_ranks, timeout_s)
        if cfg.recover.data_plane == "torch":
            group = _torch_plane(group, ctx, torch.cuda.is_available(), timeout_s, hang_s)
        runtime.track_group(group)
        if cfg.recover.cuda_aware_mpi:
            group.set_direct_device(True)  # a ValueError unless the MPI is CUDA-aware
    if par.ranks_per_replica > 1:
        # MPI ranks: a standby's torch world starts past the training ranks.
        replica_ranks = collective.world_ranks(dist.get_process_group_ranks(replica_group))
        runtime.set_replica_peers(replica_ranks)  # the exit hook asks MPI about them
        if hang_s:
            runtime.start_replica_gate(replica_ranks, hang_s / 4)
    pg_collection = process_groups(group.process_group if group else None, instances,
                                   expert_parallel=par.expert_model_parallel_size > 1)
    ddp_chunks = wrap_ddp(chunks, tconfig, mcore_config.to_ddp_config(cfg), pg_collection)
    if cfg.model.moe is not None and dist.get_rank() == 0:
        print(f"megatron-recover: rank 0's gradient buckets in the order backward completes "
              f"them, and they are reduced: {', '.join(bucket_kinds(ddp_chunks))} (expert: "
              "megatron's separate buffer)", flush=True)
    # With instances the optimizer takes the same groups (a standby instance's megatron state
    # has no group across instances); without, megatron's own, as Megatron-LM builds it.
    optimizer, scheduler = _optimizer_and_scheduler(cfg, ddp_chunks,
                                                    pg_collection if instances else None)
    tconfig.grad_scale_func = optimizer.scale_loss
    if (len(ddp_chunks) > 1 and par.overlap_param_gather and par.align_param_gather
            and not cfg.recover.enabled):
        # As Megatron-LM: the interleaved schedule dispatches the later chunks' all-gathers.
        # (--recover dispatches every chunk's after the optimizer step: DDPBuffers.)
        tconfig.param_sync_func = [chunk.start_param_sync for chunk in ddp_chunks]
    shard_control_group = None if shard_group is None else groups.mirror_of(shard_group)
    if par.use_distributed_optimizer:
        # As Megatron-LM gives it one: the gloo group its data-parallel shards gather on for a
        # --ckpt-format torch checkpoint's distrib_optim.pt (megatron-core's
        # save_parameter_state and load_parameter_state).
        gloo = shard_control_group or groups.mirror_of(
            parallel_state.get_data_parallel_group(with_context_parallel=True))
        for distributed in training_state.distributed_optimizers(optimizer):
            distributed.data_parallel_group_gloo = gloo
    return RankSetup(
        chunks=tuple(ddp_chunks), optimizer=optimizer, scheduler=scheduler, group=group,
        replica_of_rank=replica_of_rank, replica_group=replica_group,
        control_group=groups.mirror_of(replica_group) if par.ranks_per_replica > 1 else None,
        shard_group=shard_group,
        shard_control_group=shard_control_group, saving_group=saving_group,
        dp_rank=parallel_state.get_data_parallel_rank(),
        replica_index=sorted(dp_group_ranks).index(dist.get_rank()),
        local_rank=dist.get_rank(group=replica_group),
        position=(parallel_state.get_tensor_model_parallel_rank(),
                  parallel_state.get_pipeline_model_parallel_rank()))


def _micro_pass(cfg, ctx, setup: RankSetup, microbatch, schedule: FailureSchedule | None,
                forward_step) -> MicrobatchPass:
    """The forward/backward pass of this rank over the user's `forward_step` (the entry's
    seam), with the failure schedule's points of its replica (a standby's: of the replica id
    it took)."""
    faults = _faults(cfg, ctx, setup, schedule)
    _optimizer_fault_points(faults, setup.optimizer, setup.chunks)
    # Exact mode reseeds dropout per microbatch id; stock Megatron draws in sequence, and so does
    # the adaptive/reserve comparison, which does not promise the reference trajectory anyway.
    reseed = cfg.recover.enabled and cfg.recover.mode == EXACT
    names = moe_losses.names(cfg.model.moe)
    return MicrobatchPass(setup.chunks, microbatch, cfg.model.seq_length,
                          cfg.micro_batch_size, cfg.seed, faults, reseed_per_microbatch=reseed,
                          check_finite=cfg.precision.check_for_nan_in_loss_and_grad,
                          aux_losses=(moe_losses.AuxLossRecorder(names, cfg.model.num_layers)
                                      if names else None),
                          forward_step=forward_step)


def _optimizer_fault_points(faults, optimizer, chunks) -> None:
    """Failure-schedule points inside megatron's optimizer step: wrap, on this rank's objects
    only, the call that enters the gradient-norm all-reduce (`clip_grad_norm`, or
    `get_grad_norm` of a chained optimizer) and the distributed optimizer's parameter
    all-gather (the first DDP model chunk's `_start_bucket_group_param_sync`: megatron-core
    0.19's distributed optimizer dispatches its bucket groups one by one through it, and so does
    DDP's `start_param_sync` with --overlap-param-gather; the point is the step's first)."""
    def before(location, method, once_per_iteration=False):
        fired = set()

        def call(*args, **kwargs):
            if not once_per_iteration or faults.iteration not in fired:
                fired.add(faults.iteration)
                faults.at_current(location)
            return method(*args, **kwargs)
        return call

    if faults.wants("grad-norm"):
        for target in [optimizer, *getattr(optimizer, "chained_optimizers", [])]:
            for name in ("clip_grad_norm", "get_grad_norm"):
                setattr(target, name, before("grad-norm", getattr(target, name)))
    if faults.wants("param-gather"):
        chunks[0]._start_bucket_group_param_sync = before(
            "param-gather", chunks[0]._start_bucket_group_param_sync, once_per_iteration=True)


def _faults(cfg, ctx, setup: RankSetup, schedule: FailureSchedule | None):
    """The failure schedule's points of this rank's replica (a standby's: once it joined)."""
    if schedule is None or (is_standby(cfg, ctx) and setup.group.size == 1):
        return NoFaults()
    # Victims write their markers beside the log: its directory may not exist yet.
    marker_path(cfg).parent.mkdir(parents=True, exist_ok=True)
    if ctx.rank == 0 and cfg.recover.log:
        # The schedule travels with the run's log (reproducible runs).
        shutil.copy(cfg.recover.failure_schedule,
                    Path(cfg.recover.log).with_suffix(".schedule.yaml"))
    return ScheduledFaults(schedule.entries, setup.replica_index, setup.local_rank, ctx.rank,
                           marker_path(cfg), schedule.overflows, schedule.bad_samples)


def _standby_faults(cfg, ctx, schedule: FailureSchedule | None):
    """A standby's own entries of the failure schedule (before it joins)."""
    if schedule is None:
        return NoFaults()
    marker_path(cfg).parent.mkdir(parents=True, exist_ok=True)
    return StandbyFaults(schedule.standbys, torch_world_id(cfg, ctx) - 1, ctx.rank,
                         marker_path(cfg))


def _install_calculator(cfg, trainer: ResilientTrainer) -> None:
    """Make megatron-core's get_num_microbatches() and get_current_global_batch_size() answer
    from this rank's policy (megatron-core has no setter for a calculator of another type)."""
    from megatron.core import num_microbatches_calculator

    shard, shards = trainer.shard
    num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR = (
        PolicyNumMicroBatchesCalculator(trainer.p.policy, trainer.p.replica, cfg.micro_batch_size,
                                        shard, shards))


def _resilient_trainer(cfg, setup: RankSetup, source, micro_pass: MicrobatchPass, policy,
                       replica: int, replica_of_rank: dict[int, int], wants_exit,
                       continued: ProtocolState | None = None) -> ResilientTrainer:
    """The resilient trainer of this rank over `source` (the `MicrobatchSource`); `continued`:
    the protocol state a standby joins with, or a resumed run's (its replicas known dead and
    its committed reserve ids)."""
    from megatron.core import parallel_state

    trainer = build_trainer(
        chunks=setup.chunks, optimizer=setup.optimizer, scheduler=setup.scheduler,
        micro_batch_size=cfg.micro_batch_size, run_pass=micro_pass.run,
        replica_group=setup.control_group, shard_group=setup.shard_group,
        shard_control_group=setup.shard_control_group,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        # Expert-parallel shards exchange tokens in every forward (all-to-all or all-gather).
        shards_in_step=cfg.parallel.expert_model_parallel_size > 1,
        synced_inside_replica=frozenset(synced_inside_replica(setup.chunks)),
        group=setup.group, policy=policy, per_token_loss=cfg.model.calculate_per_token_loss,
        check_finite=cfg.precision.check_for_nan_in_loss_and_grad,
        computes_loss=parallel_state.is_pipeline_last_stage(),
        replica=replica, replica_of_rank=replica_of_rank, faults=micro_pass.faults,
        audit=DatasetAudit(source.dataset, global_batch_size=cfg.global_batch_size,
                          micro_batch_size=cfg.micro_batch_size, main_samples=cfg.main_samples,
                          policy=cfg.recover.policy, mode=cfg.recover.mode,
                          step_batch_size_schedule=cfg.step_batch_size_schedule,
                          seq_length=cfg.model.seq_length,
                          committed_reserve=continued.committed_reserve if continued else ()),
        restore=cfg.recover.restore, wants_exit=wants_exit,
        verification=(Verification(cfg.recover.sdc_check_rate, cfg.seed,
                                   cfg.recover.sdc_tolerance)
                      if cfg.recover.sdc_check_rate > 0 else None),
        nonfinite_rerun=cfg.recover.nonfinite_rerun, samples_of=source.sample_range,
        side_size=0 if micro_pass.aux_losses is None else micro_pass.aux_losses.size,
        side_sums=None if micro_pass.aux_losses is None else micro_pass.aux_losses.sums,
        dead_replicas=continued.dead_replicas if continued else frozenset())
    _install_calculator(cfg, trainer)
    return trainer


@dataclass
class Trained:
    """What a rank ends training with (its status file reports the scaler's part)."""

    model: object  # megatron's GPTModel, unwrapped
    loss_scale: float  # the optimizer's final loss scale (1.0 without fp16 scaling)
    skipped_iterations: list[int]  # iterations whose step the fp16 loss scaler skipped
    joined: dict | None = None  # a standby that joined: its join, as it saw it
    snapshots: dict | None = None  # a snapshot writer's seconds per copy and per write


def train(cfg, ctx: runtime.DistributedContext, source, vocab_size: int,
          schedule: FailureSchedule | None, *, model_provider, forward_step) -> Trained:
    """Train for cfg.train_iters iterations on `source` (a MicrobatchSource), or until an
    --exit-* flag stops every rank after the same iteration; the lowest live rank prints and
    logs. `schedule`: the failure schedule `check_start` read; `model_provider` and
    `forward_step`: the entry's seams (pretrain_gpt_recover.py). A standby waits here until it
    is called; one that is dismissed leaves the run from here."""
    # Every rank, standbys too, takes part in opening the pool (an MPI world collective).
    pool = (standby.Pool.open(cfg.parallel.world_size, cfg.parallel.ranks_per_replica)
            if cfg.recover.standby_replicas else None)
    setup = build(cfg, ctx, vocab_size, model_provider)
    exits = ExitRequests(cfg)
    if not cfg.recover.enabled:
        micro_pass = _micro_pass(cfg, ctx, setup, source.microbatch, schedule, forward_step)
        progress = Progress(cfg, setup, micro_pass, source, vocab_size, exits)
        stepper = _agreed_start(lambda: StockStepper(cfg, ctx.rank, setup, micro_pass, exits),
                                finalize=True)
        return _run(setup, progress, stepper)
    call = None
    if is_standby(cfg, ctx):
        call = joins.wait_for_call(cfg.num_replicas, setup, pool,
                                   _standby_faults(cfg, ctx, schedule), runtime.leave)
        if call is None:  # never returns
            runtime.finish(standby="idle", reason=pool.end_reason, waited_s=pool.waited_s,
                           wait_cpu_s=pool.wait_cpu_s)
        setup = dataclasses.replace(setup, replica_index=call.replica_index)
        training_state.restore(call.state, setup.chunks, setup.optimizer, setup.scheduler)
    micro_pass = _micro_pass(cfg, ctx, setup, source.microbatch, schedule, forward_step)
    joined = None
    if call is not None:
        policy = resume_policy(call.protocol, mcore_config.to_policy_config(cfg))
        trainer = _resilient_trainer(cfg, setup, source, micro_pass, policy,
                                     setup.replica_index, dict(call.protocol.replica_of_rank),
                                     exits.requested, continued=call.protocol)
        first_iteration, joined = joins.continue_as_joiner(trainer, call, setup, pool)
    else:
        start = _agreed_start(lambda: resume.starting_point(cfg, ctx.rank, setup))
        # Replica ids are the policy's (original ids when resumed); ranks map through dp rank.
        replica_of_rank = {rank: start.replica_ids[dp]
                           for rank, dp in setup.replica_of_rank.items()}
        trainer = _resilient_trainer(cfg, setup, source, micro_pass, start.policy,
                                     start.replica_ids[setup.replica_index], replica_of_rank,
                                     exits.requested, continued=start.protocol)
        first_iteration = start.first_iteration
    progress = Progress(cfg, setup, micro_pass, source, vocab_size, exits, trainer)
    snapshots = (_snapshots(cfg, ctx, setup, trainer, schedule)
                 if cfg.recover.snapshot_interval else None)
    grow_back = None if pool is None else functools.partial(joins.grow_back, cfg.num_replicas,
                                                            trainer, setup, pool)
    stepper = ResilientStepper(cfg, ctx.rank, setup, trainer, first_iteration, progress,
                               snapshots, grow_back, joined)
    # From the first iteration on (not during start-up, a resume or a standby's wait, when a
    # world-wide gloo collective can fail for a peer outside this replica): docs/failures.md.
    runtime.set_program_errors(cfg.recover.program_errors)
    trained = _run(setup, progress, stepper)
    if pool is not None:
        pool.dismiss()
    return dataclasses.replace(trained, joined=joined, snapshots=stepper.snapshot_seconds())


def _run(setup: RankSetup, progress: Progress, stepper) -> Trained:
    try:
        skipped = run_loop(progress.cfg, progress, stepper)
    finally:
        progress.writers.close()
    return Trained(setup.unwrapped_model(), float(setup.optimizer.get_loss_scale()), skipped)


def _snapshots(cfg, ctx, setup: RankSetup, trainer: ResilientTrainer,
               schedule: FailureSchedule | None) -> snapshot.Snapshots:
    """This rank's snapshot writer, with the failure schedule's slow writes. Collective over
    the training ranks (where each rank is: one copy per node and position is enough)."""
    where = [None] * dist.get_world_size()
    dist.all_gather_object(where, (socket.gethostname(), setup.checkpoint_position),
                           group=groups.world_control())
    replicas_here = sorted(trainer.p.replica_of_rank[rank] for rank, place in enumerate(where)
                           if place == where[dist.get_rank()])
    slow, on_pause = {}, None
    if schedule is not None:
        markers = marker_path(cfg)
        # A relaunch that redoes an iteration does not pause its write again: once per job.
        paused = {m["iteration"] for m in read_markers(markers)
                  if m.get("location") == "snapshot-write"}
        slow = {t: s for t, s in schedule.slow_snapshot_writes.items() if t not in paused}

        def on_pause(iteration):
            write_marker(markers, "snapshot-write", ctx.rank,
                         {"location": "snapshot-write", "iteration": iteration})
    return snapshot.Snapshots(cfg.recover.snapshot_dir, cfg.recover.snapshot_interval,
                              setup.checkpoint_position, trainer.p.replica, replicas_here, slow,
                              on_pause)
