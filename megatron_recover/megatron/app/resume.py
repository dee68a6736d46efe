"""Where a --recover run starts: the newest state the job left (in-memory snapshots after a
relaunch, or the on-disk checkpoint of --load, whichever is newer) and the policy that continues
it on this run's replicas. What checkpoints and snapshots record of the protocol, so that a later
run can continue, is `recovery.protocol_state.ProtocolState`, as a standby's join carries it.
"""

import time
from dataclasses import dataclass, replace

from megatron_recover.megatron.persistence import (
    torch_format as checkpoint,
    torch_dist as dist_checkpoint,
    loading,
    snapshots as snapshot,
)
from megatron_recover.megatron.config import mcore_config
from megatron_recover.megatron.app.rank_setup import RankSetup
from megatron_recover.policy import ADAPTIVE, WorkloadPolicy
from megatron_recover.recovery.protocol_state import ProtocolState, resume_policy


@dataclass
class Start:
    """How a rank's resilient training begins."""

    policy: WorkloadPolicy
    replica_ids: list[int]  # the policy's replica id of each data-parallel rank
    first_iteration: int
    # The protocol state resumed (None: a fresh run): its dead replicas (without this run's
    # ids) and committed reserve ids go to the trainer, as a joiner's do.
    protocol: ProtocolState | None = None


def starting_point(cfg, rank: int, setup: RankSetup) -> Start:
    """A fresh policy from iteration 1, or the one continuing the newest state the job left."""
    state, source = load_newest(cfg, rank, setup)
    if state is None:
        return Start(WorkloadPolicy(mcore_config.to_policy_config(cfg)),
                     list(range(cfg.num_replicas)), 1)
    policy, replica_ids = resumed_policy(cfg, state, cfg.num_replicas)
    if rank == 0:
        print(f"megatron-recover: resumed iteration {state.iteration} from {source}: replicas "
              f"{replica_ids} continue the run's {list(state.live_replicas)}", flush=True)
    continued = replace(state, dead_replicas=state.dead_replicas - set(replica_ids))
    return Start(policy, replica_ids, state.iteration + 1, continued)


def load_newest(cfg, rank: int, setup: RankSetup) -> tuple[ProtocolState | None, str]:
    """Load the newest state this job left into the model, optimizer and scheduler: in-memory
    snapshots (after a relaunch) unless the on-disk checkpoint of --load is newer; (None, "")
    when there is neither, or when the checkpoint is a fine-tune's start (`loading.py`: the
    model only, the run from iteration 1). Returns the protocol state and where it came from."""
    say = loading.printer(rank)
    plan = loading.plan(cfg.checkpoint, say=say)
    on_disk = plan.iteration if plan is not None and plan.resumes else None
    start = time.perf_counter()
    if cfg.recover.snapshot_interval:
        state = snapshot.restore(cfg.recover.snapshot_dir, setup.group,
                                 setup.checkpoint_position, setup.chunks, setup.optimizer,
                                 setup.scheduler, after=on_disk or 0)
        if state is not None:
            return state, (f"in-memory snapshots in {cfg.recover.snapshot_dir} "
                           f"({time.perf_counter() - start:.3f} s)")
    if plan is not None:
        state = _load(cfg, plan, setup)
        took = f"{time.perf_counter() - start:.3f} s"
        if not plan.resumes:
            say(f"megatron-recover: fine-tuning from {plan.path} ({took}): its model, a fresh "
                "optimizer, scheduler and generators, from iteration 1")
            return None, ""
        return state, f"{plan.path} ({took})"
    if cfg.checkpoint.load:
        # As Megatron-LM: a job script passes the same --load on its first launch.
        say(f"megatron-recover: --load {cfg.checkpoint.load} holds no checkpoint (no "
            f"{checkpoint.TRACKER}): training from scratch")
    return None, ""


def _load(cfg, plan, setup: RankSetup) -> ProtocolState:
    """Load the checkpoint `plan` names, in the format it was written in. A checkpoint Megatron-LM
    or a stock run wrote holds no protocol state: the policy starts afresh at its iteration, on
    every replica of this run."""
    if dist_checkpoint.is_torch_dist(plan.path):
        iteration, saved = dist_checkpoint.load(plan, setup.chunks, setup.optimizer,
                                                setup.scheduler, cfg)
    else:
        iteration, saved = checkpoint.load(plan, setup.chunks, setup.optimizer,
                                           setup.scheduler, setup.checkpoint_position,
                                           cfg.parallel.pipeline_model_parallel_size, cfg)
    if saved is not None:
        return ProtocolState.from_state_dict(saved)
    return ProtocolState.initial(mcore_config.to_policy_config(cfg), iteration)


def _ramp_text(ramp) -> str:
    """A batch-size schedule's B per iteration before its last step, shortened."""
    if not ramp:
        return "no smaller batches"
    shown = ", ".join(map(str, ramp[:8])) + (", ..." if len(ramp) > 8 else "")
    return f"{len(ramp)} iterations of {shown}"


def resumed_policy(cfg, state: ProtocolState, num_replicas: int):
    """(policy, replica id of each data-parallel rank) continuing a checkpoint or snapshot on
    `num_replicas` replicas, keeping B. Original replica ids are reused: the survivors' first."""
    config = mcore_config.to_policy_config(cfg)
    if cfg.b != state.b or config.ramp != state.ramp:
        raise ValueError(f"resuming: the checkpoint or snapshot has B = {state.b} microbatches "
                         f"per iteration (before it {_ramp_text(state.ramp)}), this run {cfg.b} "
                         f"(before it {_ramp_text(config.ramp)}): keep --global-batch-size, "
                         "--micro-batch-size and --step-batch-size-schedule")
    if (cfg.recover.policy, cfg.recover.mode) != (state.policy, state.mode):
        raise ValueError(f"resuming: the checkpoint or snapshot ran --recover-policy "
                         f"{state.policy} --recover-mode {state.mode}; resume with the same")
    if num_replicas > state.w_init:
        raise ValueError(f"resuming: {num_replicas} replicas, but the run started with "
                         f"{state.w_init}; resume with at most that many")
    live = list(state.live_replicas)
    spare_ids = [r for r in range(state.w_init) if r not in live]
    ids = sorted((live + spare_ids)[:num_replicas])
    if ids != sorted(live) and state.policy == ADAPTIVE:
        raise ValueError(f"resuming: the adaptive policy resumes on its {len(live)} live "
                         f"replicas only, not {num_replicas}")
    return resume_policy(state, config, ids), ids
