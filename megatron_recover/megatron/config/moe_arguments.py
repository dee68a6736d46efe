"""Megatron-LM's mixture-of-experts flags: their parser group, their checks and the MoEConfig
they make. Pure, like arguments.py: nothing here imports torch.

Under --recover a replica must hold every expert: the expert-parallel group of each MoE layer
lies inside one replica, which with expert parallelism is a distributed-optimizer instance
(its data-parallel ranks split the experts; docs/training.md, "Mixture of experts").
"""

from __future__ import annotations

import argparse
import re

from megatron_recover.megatron.config.train_config import MoEConfig

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DISPATCHERS = ("allgather", "alltoall")


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int)
    g.add_argument("--moe-layer-freq", default="1")
    g.add_argument("--moe-ffn-hidden-size", type=int)
    g.add_argument("--moe-router-topk", type=int, default=2)
    # Megatron-LM takes several types (one coefficient each); one is what we implement.
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default=["aux_loss"])
    g.add_argument("--moe-aux-loss-coeff", nargs="+", type=float, default=[0.0])
    g.add_argument("--moe-z-loss-coeff", type=float)
    g.add_argument("--moe-token-dispatcher-type", default="allgather")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int)
    g.add_argument("--moe-expert-capacity-factor", type=float)
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-topk-scaling-factor", type=float)
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"])
    g.add_argument("--moe-router-num-groups", type=int)
    g.add_argument("--moe-router-group-topk", type=int)
    g.add_argument("--moe-per-layer-logging", action="store_true")
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-permute-fusion", action="store_true")
    g.add_argument("--moe-router-fusion", action="store_true")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int)


def _defaults() -> dict:
    """Each MoE flag's default (its dest -> value), read from `add_moe_args`."""
    parser = argparse.ArgumentParser(add_help=False)
    add_moe_args(parser)
    return vars(parser.parse_args([]))


def _value(ns, flag: str):
    return getattr(ns, flag[2:].replace("-", "_"))


def layer_pattern(text: str, num_layers: int) -> tuple[int, ...] | str:
    """--moe-layer-freq as Megatron-LM reads it: an interval N (layer i is MoE when i % N == 0)
    or a Python list expression of 0s and 1s, one per layer ("[1,0]*2", "([0]+[1]*3)*2").
    Returns the pattern, or a problem line."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        every = int(text)
        if every < 1:
            return f"--moe-layer-freq must be a positive interval or a list, got {text}"
        return tuple(int(i % every == 0) for i in range(num_layers))
    if not re.fullmatch(r"[\[\]()0-9*+, ]+", text):
        return (f"--moe-layer-freq {text!r}: give an interval (an integer) or a list expression "
                "of 0s and 1s such as \"([0]+[1]*3)*2\"")
    try:
        pattern = eval(text, {"__builtins__": {}}, {})  # only brackets, digits, * + and commas
    except Exception:  # noqa: BLE001 - any malformed expression is the user's to fix
        pattern = None
    if not isinstance(pattern, list) or any(x not in (0, 1) for x in pattern):
        return f"--moe-layer-freq {text!r} is not a list of 0s and 1s"
    if len(pattern) != num_layers:
        return (f"--moe-layer-freq {text!r} has {len(pattern)} entries for --num-layers "
                f"{num_layers}: give one per layer")
    return tuple(pattern)


def problems(ns, world_size: int) -> list[str]:
    """Megatron-LM's and megatron-core's rules for the MoE flags, and --recover's layout rule.
    Reads the required model and parallel arguments (checked before)."""
    ep = ns.expert_model_parallel_size
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    if ns.num_experts is None:
        # Every MoE flag means nothing without --num-experts.
        given = [f"--{dest.replace('_', '-')}" for dest, default in _defaults().items()
                 if getattr(ns, dest) != default]
        return ([f"{', '.join(given)} configure mixture-of-experts layers: add --num-experts or "
                 "drop them"] if given else [])
    found = []
    if ns.num_experts < 1:
        return [f"--num-experts must be a positive integer, got {ns.num_experts}"]
    if ep < 1 or ns.num_experts % ep:
        found.append(f"--num-experts {ns.num_experts} is not divisible by "
                     f"--expert-model-parallel-size {ep}: each expert-parallel rank holds "
                     "the same number of experts")
    if ns.expert_tensor_parallel_size not in (None, tp):
        found.append(f"--expert-tensor-parallel-size {ns.expert_tensor_parallel_size}: experts "
                     f"split over tensor-parallel ranks other than the dense layers' "
                     f"({tp}) are not supported; leave it out (Megatron-LM's default: "
                     "--tensor-model-parallel-size)")
    if tp > 1 and not ns.sequence_parallel:
        found.append("mixture-of-experts layers with tensor parallelism need --sequence-parallel "
                     "(as in Megatron-LM; megatron-core's MoE layer refuses it otherwise): add it")
    dp = world_size // (tp * pp)
    if ep > 1 and dp % ep:
        found.append(f"data-parallel size {dp} is not divisible by --expert-model-parallel-size "
                     f"{ep}: the experts are split over data-parallel ranks")
    if not 1 <= ns.moe_router_topk <= ns.num_experts:
        found.append(f"--moe-router-topk {ns.moe_router_topk} must be between 1 and "
                     f"--num-experts {ns.num_experts}")
    elif ns.moe_router_topk == 1 and not ns.moe_router_pre_softmax \
            and ns.moe_router_score_function == "softmax":
        found.append("--moe-router-topk 1 needs --moe-router-pre-softmax (megatron-core's rule)")
    types = ns.moe_router_load_balancing_type
    if len(types) != 1 or types[0] not in LOAD_BALANCING_TYPES:
        found.append(f"--moe-router-load-balancing-type {' '.join(types)}: choose one of "
                     f"{', '.join(LOAD_BALANCING_TYPES)} (global_aux_loss sums over the "
                     "data-parallel ranks that ran each microbatch, and sinkhorn needs no "
                     "auxiliary loss but is not supported; several types at once are not "
                     "supported either)")
    if len(ns.moe_aux_loss_coeff) != 1 or ns.moe_aux_loss_coeff[0] < 0:
        found.append(f"--moe-aux-loss-coeff {' '.join(map(str, ns.moe_aux_loss_coeff))}: give "
                     "one coefficient >= 0")
    if ns.moe_token_dispatcher_type not in DISPATCHERS:
        found.append(f"--moe-token-dispatcher-type {ns.moe_token_dispatcher_type}: choose "
                     f"{' or '.join(DISPATCHERS)} (flex needs the DeepEP or HybridEP kernels, "
                     "which are not supported)")
    if ns.moe_pad_expert_input_to_capacity and ns.moe_expert_capacity_factor is None:
        found.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    groups, group_topk = ns.moe_router_num_groups, ns.moe_router_group_topk
    if (group_topk is None) != (groups is None):
        found.append("--moe-router-group-topk and --moe-router-num-groups go together: give "
                     "both or neither")
    elif groups is not None and (groups < 1 or ns.num_experts % groups
                                 or not 1 <= group_topk <= groups):
        found.append(f"--moe-router-num-groups {groups} must divide --num-experts "
                     f"{ns.num_experts}, and --moe-router-group-topk {group_topk} be between 1 "
                     "and it")
    pattern = layer_pattern(ns.moe_layer_freq, ns.num_layers)
    if isinstance(pattern, str):
        found.append(pattern)
    for flag in ("--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size"):
        if _value(ns, flag) is not None and _value(ns, flag) < 1:
            found.append(f"{flag} must be a positive integer, got {_value(ns, flag)}")
    if ns.recover:
        found += _recover_layout(ns, dp)
    return found


def _recover_layout(ns, dp: int) -> list[str]:
    """Under --recover every expert-parallel group lies inside one replica."""
    ep = ns.expert_model_parallel_size
    found = []
    if ep > 1:
        k = ns.num_distributed_optimizer_instances
        tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
        if not ns.use_distributed_optimizer:
            found.append(
                f"--expert-model-parallel-size {ep} under --recover: an expert-parallel group "
                "must lie inside one replica, so that a failure takes all of a layer's experts "
                "down together and the survivors hold complete copies; a replica then holds "
                "several data-parallel ranks, which is a distributed-optimizer instance: add "
                f"--use-distributed-optimizer (start-up then makes each replica {ep} "
                "data-parallel ranks, one expert-parallel group), or with it "
                f"--num-distributed-optimizer-instances K, K dividing {dp // ep} (each replica "
                f"{dp}/K data-parallel ranks, a multiple of {ep})")
        elif k is None and dp % ep == 0 and dp // ep < 2:
            found.append(
                f"--expert-model-parallel-size {ep} under --recover with {dp} data-parallel "
                f"ranks: a replica holds a whole expert-parallel group ({ep} data-parallel "
                f"ranks), so they make {dp // ep} replica, which no failure leaves alive: "
                f"launch a multiple of {2 * ep * tp * pp} ranks (2 replicas or more)")
        elif k is not None and dp % k == 0 and (dp // k) % ep:
            found.append(
                f"--expert-model-parallel-size {ep} does not divide the {dp // k} data-parallel "
                f"ranks of a replica (--num-distributed-optimizer-instances {k}): an "
                "expert-parallel group would span two replicas, and a failure would cut it "
                f"apart; choose K so that {dp}/K is a multiple of {ep}")
    if ep > 1 and ns.ckpt_format == "torch":
        found.append(f"--ckpt-format torch with --expert-model-parallel-size {ep}: that format "
                     "writes one file per tensor and pipeline position, which holds the experts "
                     "of one expert-parallel rank only; use --ckpt-format torch_dist (the "
                     "default), which shards the experts")
    if ns.recompute_granularity == "full":
        found.append("--recompute-granularity full with mixture-of-experts layers under "
                     "--recover: a recomputed layer attaches its router's auxiliary loss again "
                     "during backward, where a padding microbatch is no longer told apart "
                     "(its auxiliary-loss gradient must be 0); use --recompute-activations "
                     "(selective: attention only) or drop recomputation")
    return found


def layout_line(ns, world_size: int, instances: int) -> str:
    """The start-up line that says where the experts live."""
    tp, pp, ep = (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size,
                  ns.expert_model_parallel_size)
    dp = world_size // (tp * pp)
    pattern = layer_pattern(ns.moe_layer_freq, ns.num_layers)
    moe_layers = sum(pattern)
    head = (f"megatron-recover: mixture of experts: {ns.num_experts} experts in {moe_layers} of "
            f"{ns.num_layers} layers, top-{ns.moe_router_topk} routing, "
            f"{ns.moe_token_dispatcher_type} dispatch, expert-parallel size {ep} "
            f"({ns.num_experts // ep} expert{'s' if ns.num_experts // ep > 1 else ''} per "
            "rank)")
    if not ns.recover:
        return f"{head}, expert data-parallel size {dp // ep}"
    if not ns.use_distributed_optimizer:
        return (f"{head}; a replica (TP {tp} x PP {pp}) holds every expert; {dp} replicas reduce "
                "dense and expert gradients across them")
    shards = dp // instances
    return (f"{head}; a replica is a distributed-optimizer instance of {shards} data-parallel "
            f"ranks (TP {tp} x PP {pp} x {shards}), each expert-parallel group inside one, so "
            f"a replica holds every expert; its ranks run passes of one length; {instances} "
            "replicas reduce dense and expert gradients across them")


def device_problems(ns, cuda_available: bool, te_available: bool,
                    grouped_gemm_available: bool, transformer_impl: str) -> list[str]:
    """The MoE flags that need a CUDA kernel, refused where it does not import, and the
    all-to-all dispatch with tensor parallelism, refused on gloo."""
    if ns.num_experts is None:
        return []
    found = []
    gloo = not cuda_available or ns.distributed_backend == "gloo"
    if gloo and ns.moe_token_dispatcher_type == "alltoall" and ns.tensor_model_parallel_size > 1:
        found.append("--moe-token-dispatcher-type alltoall with --tensor-model-parallel-size > 1 "
                     "on gloo (the CPU, or --distributed-backend gloo): megatron-core gathers "
                     "each rank's routed tokens over the tensor-parallel group in uneven parts, "
                     "which gloo's all-gather refuses (NCCL's takes them); use "
                     "--moe-token-dispatcher-type allgather here")
    kernel = te_available if transformer_impl == "transformer_engine" else grouped_gemm_available
    if ns.moe_grouped_gemm and not (cuda_available and kernel):
        which = ("Transformer Engine's" if transformer_impl == "transformer_engine"
                 else "the grouped_gemm package's, with --transformer-impl local")
        found.append(f"--moe-grouped-gemm runs the experts as one grouped GEMM, a CUDA kernel "
                     f"({which}), which does not import here: drop it (each expert then runs "
                     "its own GEMM, the same sums)")
    for flag, given in (("--moe-permute-fusion", ns.moe_permute_fusion),
                        ("--moe-router-fusion", ns.moe_router_fusion)):
        if given and not (cuda_available and te_available):
            found.append(f"{flag} needs Transformer Engine's fused CUDA kernels, which do not "
                         "import here: drop it (the unfused path computes the same)")
    return found


def moe_config(ns, ffn_hidden_size: int) -> MoEConfig | None:
    """The MoEConfig of validated arguments; None without --num-experts."""
    if ns.num_experts is None:
        return None
    return MoEConfig(
        num_experts=ns.num_experts,
        layer_pattern=layer_pattern(ns.moe_layer_freq, ns.num_layers),
        ffn_hidden_size=ns.moe_ffn_hidden_size or ffn_hidden_size,
        router_topk=ns.moe_router_topk,
        load_balancing_type=ns.moe_router_load_balancing_type[0],
        aux_loss_coeff=ns.moe_aux_loss_coeff[0], z_loss_coeff=ns.moe_z_loss_coeff,
        token_dispatcher_type=ns.moe_token_dispatcher_type,
        shared_expert_intermediate_size=ns.moe_shared_expert_intermediate_size,
        expert_capacity_factor=ns.moe_expert_capacity_factor,
        pad_expert_input_to_capacity=ns.moe_pad_expert_input_to_capacity,
        token_drop_policy=ns.moe_token_drop_policy,
        router_pre_softmax=ns.moe_router_pre_softmax,
        router_score_function=ns.moe_router_score_function,
        router_topk_scaling_factor=ns.moe_router_topk_scaling_factor,
        router_dtype=ns.moe_router_dtype, router_num_groups=ns.moe_router_num_groups,
        router_group_topk=ns.moe_router_group_topk,
        per_layer_logging=ns.moe_per_layer_logging, grouped_gemm=ns.moe_grouped_gemm,
        permute_fusion=ns.moe_permute_fusion, router_fusion=ns.moe_router_fusion)
