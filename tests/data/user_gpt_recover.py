"""A user's own pretrain script, as one writes it for Megatron-LM: its own `model_provider` (a
GPT whose final norm is an RMSNorm with a learnable output scale, the "head scale", which
megatron-core's GPT does not have) and its own `forward_step` (the entry's `get_batch` and
`loss_func` around the model), handed to the entry's `pretrain`. tests/test_user_provider.py
trains it under --recover with a failure.

Each rank notes which of its seams ran, once per kind, in
$MEGATRON_RECOVER_STATUS_DIR/user-seams-RANK.jsonl, so the test sees that the run called them
(the forward step in training and in evaluation).
"""

import json
import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's entry point
import pretrain_gpt_recover as entry  # noqa: E402

HEAD_SCALE = 2.0  # the head scale's initial value
_noted = set()


def note(seam: str, **what) -> None:
    """Record once per process that `seam` ran (with `what`)."""
    key = (seam, *sorted(what.items()))
    status_dir = os.environ.get("MEGATRON_RECOVER_STATUS_DIR")
    if key in _noted or not status_dir:
        return
    _noted.add(key)
    import torch.distributed as dist

    with open(Path(status_dir) / f"user-seams-{dist.get_rank()}.jsonl", "a") as out:
        out.write(json.dumps({"seam": seam, **what}) + "\n")


class ScaledFinalNorm(torch.nn.Module):
    """RMSNorm times a learnable scalar: built by megatron-core's transformer block with the
    arguments it gives its final layer norm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.head_scale = torch.nn.Parameter(
            torch.full((1,), HEAD_SCALE, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps) * self.head_scale


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None):
    """A GPTModel with `ScaledFinalNorm` as its final norm, built with the run's `config`."""
    from megatron.core.models.gpt import GPTModel

    from megatron_recover.megatron.adapters.gpt import get_args, layer_specs

    args = get_args()
    options = args.cfg.model  # the model's arguments (a ModelConfig)
    spec = layer_specs(config, options.transformer_impl, vp_stage)
    spec.layer_norm = ScaledFinalNorm  # the transformer block's final norm
    note("model_provider", vp_stage=vp_stage, pre_process=pre_process, post_process=post_process)
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=options.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                    share_embeddings_and_output_weights=(
                        not options.untie_embeddings_and_output_weights),
                    position_embedding_type=options.position_embedding_type)


def forward_step(data_iterator, model):
    """The entry's batch and loss around the model, as a user's forward step."""
    note("forward_step", training=model.training)
    tokens, labels, loss_mask, attention_mask, position_ids = entry.get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(entry.loss_func, loss_mask)


if __name__ == "__main__":
    entry.pretrain(model_provider, forward_step)
