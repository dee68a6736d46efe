"""megatron-core GPT pieces for pretrain_gpt_recover.py: model, DDP wrapper, the microbatch pass.

The pass runs explicit microbatch ids (the policy's) through megatron's own schedule
(`get_forward_backward_func()`); in exact mode every microbatch reseeds the RNGs from its id,
so a microbatch recomputed on another replica after a failure draws the same dropout masks.

The seams of pretrain_gpt_recover.py (Megatron-LM's `model_provider` and `forward_step`) are
the user's: `build_model_chunks` calls the model provider, and `MicrobatchPass` and the
evaluation (evaluation.py) wrap the forward step with what resilience needs around it (the
ledger, reseeding, padding, fault points, the loss check); the user's function sees one batch
and the model, and returns the output and its loss function, as in Megatron-LM.
"""

import random
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from megatron_recover import errors
from megatron_recover.megatron.adapters import devices, hooks, interleaving
from megatron_recover.megatron.data.datasets import BATCH_KEYS, batch_checksum
from megatron_recover.megatron.adapters.norms import Norm

_SEED_STRIDE = 1_000_003  # > any B: (iteration, id) pairs map to distinct seeds
_MAX_STAGES = 1024  # > any pipeline depth: each stage's dropout draws from its own seeds


def layer_specs(transformer_config, transformer_impl: str, vp_stage: int | None = None):
    """The transformer block of this pipeline stage (of its virtual stage `vp_stage` with the
    interleaved schedule): Transformer Engine's layer spec, or
    megatron-core's local spec with our `Norm` in every norm position (megatron-core's torch
    norm refuses zero-centred gamma and sequence parallelism). With mixture-of-experts layers,
    megatron-core's decoder block spec (as Megatron-LM's GPT builder takes it), which places
    MoE and dense layers by --moe-layer-freq."""
    te = transformer_impl == "transformer_engine"
    if transformer_config.num_moe_experts is not None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        block = get_gpt_decoder_block_spec(transformer_config, use_transformer_engine=te,
                                           normalization=transformer_config.normalization,
                                           vp_stage=vp_stage)
        if not te:
            for spec in block.layer_specs:  # fresh specs per call: ours to change
                _local_norms(spec.submodules, transformer_config.qk_layernorm)
            block.layer_norm = Norm
        return block
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=transformer_config.qk_layernorm)
    spec = get_gpt_layer_local_spec(qk_layernorm=transformer_config.qk_layernorm,
                                    normalization=transformer_config.normalization)
    _local_norms(spec.submodules, transformer_config.qk_layernorm)
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(transformer_config, vp_stage=vp_stage),
        layer_norm=Norm)


def _local_norms(layer, qk_layernorm: bool) -> None:
    """Our `Norm` in every norm position of a local layer spec's submodules."""
    layer.input_layernorm = layer.pre_mlp_layernorm = Norm
    if qk_layernorm:
        attention = layer.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = Norm


def build_gpt(transformer_config, vocab_size: int, model, vp_stage: int | None = None,
              pre_process: bool | None = None, post_process: bool | None = None) -> GPTModel:
    """This rank's GPTModel (its model chunk `vp_stage` with the interleaved schedule), as
    Megatron-LM's GPT builder makes it from the arguments in `model` (a ModelConfig);
    `vocab_size` is the padded one. `pre_process` / `post_process` (None: this rank's pipeline
    stage says) whether the chunk holds the embedding / the output layer and loss."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
    return GPTModel(
        config=transformer_config,
        transformer_layer_spec=layer_specs(transformer_config, model.transformer_impl, vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        rotary_percent=model.rotary_percent,
        rotary_base=model.rotary_base,
    )


@dataclass(frozen=True)
class ProviderArgs:
    """What `get_args()` gives a model provider or forward step, as Megatron-LM's `get_args()`
    gives its own: the run's arguments and the vocabulary size padded as Megatron-LM pads it."""

    cfg: object  # the run's validated TrainConfig (config.py): cfg.model, cfg.parallel, ...
    padded_vocab_size: int


_provider_args: ProviderArgs | None = None


def get_args() -> ProviderArgs:
    """The run's `ProviderArgs`, from the model's build on (`build_model_chunks`)."""
    if _provider_args is None:
        raise RuntimeError("get_args(): the run has not started building its model yet")
    return _provider_args


def build_model_chunks(model_provider, cfg, transformer_config, padded_vocab_size: int) -> list:
    """This rank's model on its device from the user's `model_provider` (Megatron-LM's seam,
    pretrain_gpt_recover.py): one chunk, or with the interleaved schedule one per virtual
    pipeline stage (Megatron-LM's model list), each in Float16Module with fp16/bf16.

    The provider is called as Megatron-LM's get_model calls it, with `pre_process`,
    `post_process` and `vp_stage`, and with `config`: the TransformerConfig the run made from
    its arguments, which the model must be built with (the schedule and the DDP wrapper read
    and set it through the model)."""
    from megatron.core.transformer.module import Float16Module

    global _provider_args
    _provider_args = ProviderArgs(cfg, padded_vocab_size)
    stages = cfg.parallel.virtual_pipeline_stages
    chunks = []
    for vp_stage in ([None] if stages is None else range(stages)):
        model = model_provider(
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                               vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=vp_stage),
            vp_stage=vp_stage, config=transformer_config)
        if getattr(model, "config", None) is not transformer_config:
            raise TypeError(f"model_provider returned {type(model).__name__} not built with the "
                            "`config` it was given: build the model with that TransformerConfig "
                            "(megatron's schedule and DDP read and set it through the model)")
        model = devices.model_to_device(model)
        if cfg.precision.fp16 or cfg.precision.bf16:
            # As Megatron-LM's get_model: fp16/bf16 parameters and compute, fp32 outputs.
            model = Float16Module(transformer_config, model)
        chunks.append(model)
    return chunks


def process_groups(cross_replica_group, across_instances=False, expert_parallel=False):
    """megatron's process groups with `cross_replica_group` (a ulfm torch group) as the
    data-parallel group or, `across_instances`, as the group between distributed-optimizer
    instances (the shards of an instance keep megatron's intra-instance group); None without
    one (megatron's own groups throughout). Without instances the experts' data-parallel group
    is the same ulfm group unless `expert_parallel` (a stock run over ulfm: megatron's own)."""
    if cross_replica_group is None:
        return None
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    if across_instances:
        # Dense and expert buckets alike: the ranks of this position in the other instances.
        pg_collection.inter_dist_opt = cross_replica_group
    else:
        pg_collection.dp = cross_replica_group
        pg_collection.dp_cp = cross_replica_group
        pg_collection.intra_dp_cp = cross_replica_group
        if not expert_parallel:  # every expert on every data-parallel rank: the same replicas
            pg_collection.expt_dp = cross_replica_group
            pg_collection.intra_expt_dp = cross_replica_group
    return pg_collection


def wrap_ddp(chunks, transformer_config, ddp_config, pg_collection=None) -> list:
    """Megatron's DDP over `pg_collection` (`process_groups`; None: megatron's groups), one per
    model chunk; as in Megatron-LM, only the first chunk's gradients are split into buckets."""
    ddps = [DistributedDataParallel(config=transformer_config, ddp_config=ddp_config,
                                    module=chunk, pg_collection=pg_collection,
                                    disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)]
    transformer_config.finalize_model_grads_func = (
        finalize_model_grads if pg_collection is None else _finalize_keeping_token_sums)
    transformer_config.no_sync_func = ([ddp.no_sync for ddp in ddps] if len(ddps) > 1
                                       else ddps[0].no_sync)
    return ddps


def synced_inside_replica(chunks) -> set:
    """The parameters whose gradients megatron-core's finalize_model_grads all-reduces in place
    inside a replica after backward, by the conditions of its helpers (0.16.1, and 0.19.0 for
    the GPT models built here; 0.19's further reductions, of conditional embedders, routers
    under flextron, the gtp_remat group and multi-token prediction, do not arise): the word
    embedding shared by the first and last pipeline stages (tied embeddings, PP > 1; with
    virtual stages the first stage's first chunk and the last stage's last chunk hold it) and,
    with TP > 1, the sequence-parallel norms, the q/k layernorms and the parameters averaged
    over the TP domain. (GPT's position-embedding group is the first stage alone: nothing to
    sync.)"""
    from megatron.core.utils import get_attr_wrapped_model

    synced = set()
    embedding_group = parallel_state.get_embedding_group(check_initialized=False)
    in_embedding_group = (embedding_group is not None and dist.get_world_size(embedding_group) > 1
                          and dist.get_rank() in dist.get_process_group_ranks(embedding_group))
    for ddp_model in chunks:
        config = ddp_model.config
        model = get_attr_wrapped_model(ddp_model, "pre_process", return_model_obj=True)
        if (in_embedding_group and model.share_embeddings_and_output_weights
                and (model.pre_process or model.post_process)):
            synced.add(model.shared_embedding_or_output_weight())
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            for name, param in model.named_parameters():
                if (getattr(param, "average_gradients_across_tp_domain", False)
                        or (config.sequence_parallel and getattr(param, "sequence_parallel", False))
                        or (config.qk_layernorm
                            and ("q_layernorm" in name or "k_layernorm" in name))):
                    synced.add(param)
    return synced


def _finalize_keeping_token_sums(model, num_tokens=None, **kwargs):
    """megatron-core's finalize_model_grads without its per-token division (under --recover).

    With --calculate-per-token-loss megatron-core would all-reduce the pass's token count over
    the stock data-parallel group (it spans replicas and is not fault tolerant) and divide the
    gradient inside every pass, before layer 2's snapshot. Here the gradient stays a sum over
    tokens; the trainer divides it once, after the commit, by the committed token count."""
    del num_tokens
    finalize_model_grads(model, **kwargs)


def seed_stage(seed: int) -> None:
    """Megatron-LM's seeding at initialization: `seed` plus 100 per pipeline stage, for Python's,
    numpy's and torch's generators and megatron's tensor-parallel RNG states."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def seed_microbatch(seed: int, iteration: int, microbatch_id: int, chunk: int = 0) -> None:
    """Seed every RNG a microbatch draws from by its identity, not its position on a replica:
    (iteration, id, pipeline stage) map to distinct seeds; with virtual pipeline stages each
    model chunk `chunk` of a rank is a stage of its own."""
    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank() + chunk * pipeline
    assert stage < _MAX_STAGES, stage
    mixed = seed + (iteration * _SEED_STRIDE + microbatch_id) * _MAX_STAGES + stage
    torch.manual_seed(mixed)
    tensor_parallel.model_parallel_cuda_manual_seed(mixed)


class _NaNGradient(torch.autograd.Function):
    """The identity whose backward gives NaN: the failure schedule's `nan` action (a device
    fault in backward that leaves the forward right)."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.clone()  # not a view: the schedule scales the loss in place

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def one_batch(batch: dict):
    """The data iterator a user's forward step gets: Megatron's GPT batch (`BATCH_KEYS`:
    tokens, labels, loss_mask, attention_mask, position_ids; attention_mask None unless the
    data set makes one), on the device, once. Which microbatch it is stays ours."""
    return iter([{key: batch.get(key) for key in BATCH_KEYS}])


def loss_and_tokens(outputs):
    """(loss sum, loss-token count as float32) from what a user's loss function returned:
    Megatron-LM's (loss, num_tokens, report), the loss summed over the microbatch's loss
    tokens. The report is the user's own; the logged loss is computed from the first two."""
    if not isinstance(outputs, tuple) or len(outputs) != 3:
        got = (f"a tuple of {len(outputs)}" if isinstance(outputs, tuple)
               else type(outputs).__name__)
        raise TypeError("forward_step's loss function must return (loss summed over the loss "
                        "tokens, the number of loss tokens, a report dict), as Megatron-LM's "
                        f"loss_func does; got {got}")
    loss, num_tokens, _ = outputs
    return loss, torch.as_tensor(num_tokens).detach().to(device=loss.device, dtype=torch.float32)


def _loss_func(user_loss, microbatch_id, on_first_loss, overflow, per_token, check_finite,
               output_tensor, bad_sample=lambda: False):
    """The user's loss function (`user_loss(output_tensor)`: Megatron-LM's loss_func with its
    loss mask bound) wrapped in what --recover needs: the mean over the microbatch's loss tokens
    or, `per_token` (--calculate-per-token-loss), their sum with the token count, which the
    schedule then leaves undivided. `check_finite`: Megatron-LM's check of the loss sum for NaN
    and inf (check_for_nan_in_loss_and_grad), raising `errors.NonFiniteLoss`. `bad_sample()`:
    the failure schedule makes this microbatch's loss NaN."""
    if bad_sample():
        output_tensor = output_tensor * float("nan")
    loss, count = loss_and_tokens(user_loss(output_tensor))
    if check_finite and not torch.isfinite(loss):
        kind = "NaN" if torch.isnan(loss) else "Inf"
        raise errors.NonFiniteLoss(f"found {kind} in local forward loss calculation")
    tokens = count.to(torch.int)
    # Reported: the sum over the loss tokens, whatever the flag; the logged loss is the
    # committed sum over the committed tokens, as Megatron-LM logs it. A copy: the schedule
    # divides the returned loss in place (and the forced overflow below is never reported).
    # Both stay on the device: they are read once after the pass (`MicrobatchPass.run`), not
    # with a host sync per microbatch between its forward and its backward.
    reported = {"id": microbatch_id, "lm loss": loss.detach().clone(), "tokens": count.detach()}
    if not per_token:
        loss = loss / count.clamp(min=1)
    if on_first_loss():
        loss = _NaNGradient.apply(loss)
    if overflow():
        loss = loss * float("inf")  # a failure-schedule test of fp16's loss scaler
    return (loss, tokens, reported) if per_token else (loss, reported)


class MicrobatchPass:
    """`run(iteration, ids, losses, tokens)`: forward/backward of `ids` through megatron's
    schedule; each id's loss summed over its loss tokens goes into `losses` and their count
    into `tokens` (on the last pipeline stage: the others see no losses).

    `forward_step(data_iterator, model)` is the user's (pretrain_gpt_recover.py): it reads one
    batch (`one_batch`), runs the model and returns (output, loss function), as Megatron-LM's.
    Around it, ours: `microbatch(iteration, id)` yields megatron's GPT batch dict, which names
    its own iteration and id; the wrapper registers that batch (with a checksum of what it
    trains on) in the gradient ledger of the model chunk it runs through, so the ledger records
    what the schedule consumed, not what it was asked to run. `faults.at("backward", t)` fires
    after the first forward of the first pass of an iteration, before its backward, on every
    pipeline stage: in the loss function on the last one, after the forward step on the others
    (where its `nan` action poisons the gradient flowing back into the stage's output).

    With virtual pipeline stages (`chunks` holds several DDP model chunks) a pass of any length
    runs through megatron's interleaved schedule as `interleaving.shape` says: padding
    microbatches are real batches with an empty loss mask, seeded apart, never reported.
    """

    def __init__(self, chunks, microbatch, seq_length: int, micro_batch_size: int, seed: int,
                 faults, reseed_per_microbatch: bool, check_finite: bool = False,
                 aux_losses=None, *, forward_step):
        self.chunks = list(chunks)
        self.microbatch = microbatch
        self.forward_step = forward_step  # the user's (evaluation goes through it too)
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.faults = faults
        self.reseed = reseed_per_microbatch
        self.check_finite = check_finite
        self.aux_losses = aux_losses  # moe_losses.AuxLossRecorder, with MoE auxiliary losses
        self.forward_backward = get_forward_backward_func()
        self._fired_backward_for = None
        self._chunk_of = {id(chunk): index for index, chunk in enumerate(self.chunks)}
        self.config = self.chunks[0].config

    def _batches(self, iteration, ids, padding: int, chunk: int):
        for microbatch_id in ids:
            if self.reseed:
                seed_microbatch(self.seed, iteration, microbatch_id, chunk)
            yield self.microbatch(iteration, microbatch_id)
        for index in range(padding):
            if self.reseed:  # apart from every id's seeds
                seed_microbatch(self.seed, iteration, _SEED_STRIDE - 1 - index, chunk)
            yield padding_batch(self.microbatch(iteration, ids[0] if ids else 0))

    def _forward_step(self, iteration, sink, data_iterator, model):
        batch = next(data_iterator)
        microbatch_id = batch["microbatch_id"]
        padding = batch.get("padding", False)
        if not padding:
            errors.note(batch["iteration"], microbatch_id)
        # Every batch consumed is in the ledger, except padding that cannot contribute (its
        # loss mask is empty, read from the batch itself).
        if sink is not None and (not padding or batch["loss_mask"].any()):
            sink.register(batch["iteration"], microbatch_id, batch_checksum(
                batch["tokens"], batch["labels"], batch["loss_mask"]),  # on the host
                chunk=self._chunk_of[id(model)])
        batch = devices.batch_to_device(batch)
        recorded = self.aux_losses is not None and not padding
        if recorded:
            self.aux_losses.before_forward()
        with hooks.padding_forward(padding):  # its MoE auxiliary losses get no gradient
            output, user_loss = self.forward_step(one_batch(batch), model)
        if recorded:
            self.aux_losses.after_forward(batch["iteration"], microbatch_id)
        if sink is not None:  # the restore's copies overlapped this forward; backward waits
            sink.restored()

        def on_first_loss() -> bool:
            if self._fired_backward_for != iteration and not padding:
                self._fired_backward_for = iteration
                return self.faults.at("backward", iteration)
            return False

        # A stage before the last computes no loss: its point is here, after its first forward.
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True) and on_first_loss():
            output = _NaNGradient.apply(output)

        # Padding is no microbatch of the schedule's: no fault of the failure schedule hits it.
        return output, partial(
            _loss_func, user_loss, None if padding else microbatch_id, on_first_loss,
            _never if padding else partial(self.faults.overflow, batch["iteration"],
                                           microbatch_id),
            self.config.calculate_per_token_loss, self.check_finite,
            bad_sample=_never if padding else partial(self.faults.bad_sample, batch["iteration"],
                                                      microbatch_id))

    def run(self, iteration: int, ids: list[int], losses: dict[int, float],
            tokens: dict[int, int], padding: int = 0, sink=None) -> None:
        """`padding`: microbatches that train on nothing, after `ids` (expert-parallel shards
        run passes of one length); the interleaved schedule may add more. `sink`
        (`interfaces.LedgerSink`): where each consumed microbatch is registered under
        --recover (the round's gradient recovery); None in a stock run."""
        self.faults.phase("schedule")
        with interleaving.shaped_pass(self.config, len(ids) + padding,
                                      parallel_state.get_pipeline_model_parallel_world_size(),
                                      len(self.chunks)) as shaping:
            padding += shaping
            outputs = self.forward_backward(
                forward_step_func=partial(self._forward_step, iteration, sink),
                data_iterator=[self._batches(iteration, ids, padding, chunk)
                               for chunk in range(len(self.chunks))],
                model=self.chunks,
                num_microbatches=len(ids) + padding,
                seq_length=self.seq_length,
                micro_batch_size=self.micro_batch_size,
                forward_only=False,
            )
        self.faults.phase("after-schedule")
        if self.aux_losses is not None:
            self.aux_losses.pass_done()
        outputs = [out for out in outputs if out["id"] is not None]  # padding's are not losses
        if outputs:  # only the last pipeline stage has losses; one host sync for the pass
            values = torch.stack([torch.stack([out["lm loss"].double(), out["tokens"].double()])
                                  for out in outputs]).tolist()
            for out, (loss, count) in zip(outputs, values):
                losses[out["id"]] = loss
                tokens[out["id"]] = int(count)


def _never() -> bool:
    return False


def padding_batch(batch: dict) -> dict:
    """A copy of `batch` that trains on nothing: its loss mask is empty (interleaving.py)."""
    return {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"]), "padding": True}
