"""Megatron GPT pre-training that survives replica failures in-step (megatron-recover).

Launch it as Megatron's pretrain_gpt.py, under MPI with fault tolerance:

    mpirun --with-ft ulfm -np 8 .venv/bin/python pretrain_gpt_recover.py \\
        --num-layers 2 --hidden-size 64 ... --recover [--recover-policy static|adaptive]

Rendezvous comes from MPI; no other environment is needed (`megatron-recover launch` sets
MEGATRON_RECOVER_STATUS_DIR, MEGATRON_RECOVER_RUN_ID and, across hosts,
MEGATRON_RECOVER_NETWORK). Without a GPU, megatron-core runs
under the CPU emulation (megatron_recover.testing).

As Megatron-LM's pretrain_gpt.py, this file holds the job's seams, `model_provider` and
`forward_step` (with `get_batch` and `loss_func`), and hands them to `pretrain`, which reads argv
and the environment, then gives a validated TrainConfig and the seams to
megatron_recover.megatron.app.run. A script of one's own replaces either seam and calls
`pretrain(model_provider, forward_step)` the same way; what the run wraps around them
(the gradient ledger, per-microbatch reseeding, padding, fault points, the loss check) is in
docs/training.md, "Your own model_provider and forward_step".
"""

import importlib
import os
import sys
from functools import partial
from pathlib import Path


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None):
    """Builds the model, as Megatron-LM's model_provider: this rank's GPTModel (its chunk
    `vp_stage` with virtual pipeline stages). `pre_process` / `post_process`: whether it holds
    the embedding / the output layer and loss. `config`: the TransformerConfig the run made
    from its arguments; the model must be built with it. `get_args()` gives the run's
    arguments (`.cfg`, a TrainConfig) and `.padded_vocab_size`."""
    from megatron_recover.megatron.adapters.gpt import build_gpt, get_args

    args = get_args()
    return build_gpt(config, args.padded_vocab_size, args.cfg.model, vp_stage,
                     pre_process=pre_process, post_process=post_process)


def get_batch(data_iterator):
    """Megatron-LM's batch: tokens, labels, loss_mask, attention_mask (None unless the data set
    makes one), position_ids, already on the device."""
    batch = next(data_iterator)
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"],
            batch["position_ids"])


def loss_func(loss_mask, output_tensor):
    """Megatron-LM's GPT loss: the per-token losses summed over the loss mask, the number of
    loss tokens, and a report. The run divides the sum (by the tokens, or not with
    --calculate-per-token-loss), checks it for NaN/inf and logs it: the report is not logged."""
    import torch

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum()
    return loss, num_tokens, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    """Forward step, as Megatron-LM's: one batch through the model; returns the output (the
    per-token losses) and the loss function with the batch's loss mask bound."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def _imports(module: str) -> bool:
    """Whether `module` imports, as megatron-core asks before using Transformer Engine's layers
    (`transformer_engine`) or Apex's kernel for gradient-accumulation fusion
    (`fused_weight_gradient_mlp_cuda`: its linear layers raise without it)."""
    try:
        importlib.import_module(module)
    except Exception:  # absent, or installed without the CUDA it needs
        return False
    return True


def pretrain(model_provider, forward_step_func) -> None:
    """Run one rank of the job of sys.argv with these seams (Megatron-LM's `pretrain`)."""
    from megatron_recover import runtime

    from megatron_recover.megatron.config import arguments
    from megatron_recover.megatron.adapters import devices, groups

    hang_timeout_s = arguments.hang_timeout_before_mpi(sys.argv[1:])
    if hang_timeout_s is not None:
        runtime.configure_hang_detection(hang_timeout_s)
    status_dir = os.environ.get("MEGATRON_RECOVER_STATUS_DIR")
    ctx = runtime.init_mpi(status_dir=Path(status_dir) if status_dir else None)

    import torch

    try:
        # Standby replicas (--recover-standby-replicas) are the last ranks, outside the world size.
        training_ranks = arguments.training_world_size(sys.argv[1:], ctx.world_size)
        cfg = arguments.parse_args(
            sys.argv[1:], world_size=training_ranks, cuda_available=torch.cuda.is_available(),
            te_available=_imports("transformer_engine"),
            fusion_kernel_available=(torch.cuda.is_available()
                                     and _imports("fused_weight_gradient_mlp_cuda")),
            grouped_gemm_available=torch.cuda.is_available() and _imports("grouped_gemm"),
            run_id=os.environ.get("MEGATRON_RECOVER_RUN_ID"))
    except (ValueError, SystemExit) as error:
        runtime.stop_at_startup(str(error) if isinstance(error, ValueError) else None)
    if ctx.rank == 0:
        import megatron.core

        training = cfg.parallel.world_size
        standbys = (f" and {ctx.world_size - training} standby"
                    if ctx.world_size > training else "")
        print(f"megatron-recover: megatron-core {megatron.core.__version__} from "
              f"{Path(megatron.core.__file__).parent}, {training}{standbys} ranks; "
              f"{cfg.precision.describe()}", flush=True)
        for line in cfg.notices:
            print(line, flush=True)
    place = devices.NodePlace.from_environment(os.environ)
    ranks_per_device = cfg.parallel.ranks_per_device
    if not torch.cuda.is_available():
        from megatron_recover.testing import enable_cpu_emulation

        enable_cpu_emulation(device_count=devices.devices_needed(place, ranks_per_device))
    try:
        devices.bind(place, ranks_per_device)  # before any tensor or group is on a device
    except ValueError as error:
        runtime.stop_at_startup(str(error))
    plan = groups.plan_groups(torch.cuda.is_available(), cfg.parallel.distributed_backend,
                              cfg.recover.cross_replica_backend)

    from megatron_recover import collective
    from megatron_recover.megatron.app import run
    from megatron_recover.megatron.persistence import training_state as state

    try:
        if cfg.recover.cross_replica_backend == "ulfm":
            collective.require_fault_tolerance()
        schedule = run.check_start(cfg)  # the failure schedule, read once
        # Before torch.distributed: megatron's dataset builder then needs no barrier (data.py).
        source, vocab_size = run.microbatch_source(cfg)
    except ValueError as error:
        runtime.stop_at_startup(str(error))
    except collective.BackendUnavailable as error:
        runtime.stop_at_startup(str(error), finalize=True)  # MPI without fault tolerance
    if ctx.rank == 0:
        from megatron_recover.megatron.config.mcore_config import padded_vocab_size

        padded = padded_vocab_size(cfg, vocab_size)
        print(f" > padded vocab (size: {vocab_size}) with {padded - vocab_size} dummy tokens "
              f"(new size: {padded})", flush=True)  # Megatron-LM's line
    # Set by `megatron-recover launch --if-include` for jobs on several hosts.
    runtime.init_torch_distributed(ctx, backend=plan.world, world_id=run.torch_world_id(cfg, ctx),
                                   network=os.environ.get("MEGATRON_RECOVER_NETWORK"))
    # A standby never called leaves inside.
    trained = run.train(cfg, ctx, source, vocab_size, schedule, model_provider=model_provider,
                        forward_step=forward_step_func)
    if status_dir:
        # Test and benchmark harnesses compare final parameters across runs.
        run.save_parameters(trained.model, Path(status_dir) / f"rank-{ctx.rank}.params.pt")
    runtime.finish(finalize=cfg.recover.cross_replica_backend != "ulfm",
                   device=devices.describe(),
                   param_digest=state.parameter_digest(trained.model),
                   loss_scale=trained.loss_scale, skipped_iterations=trained.skipped_iterations,
                   **({} if trained.joined is None else {"joined": trained.joined}),
                   **({} if trained.snapshots is None else {"snapshots": trained.snapshots}))


if __name__ == "__main__":
    pretrain(model_provider, forward_step)
