"""Evaluation on the validation split (and the test split at the end), as Megatron-LM's
`evaluate`: --eval-iters global batches every --eval-interval iterations and once at the end.

Evaluation k reads the split's E = eval_iters x B microbatches after those of evaluations
1..k-1 (`MicrobatchSource.eval_microbatch`), each through megatron's schedule with
forward_only=True, in eval mode (no dropout). The value is Megatron-LM's: the loss summed over
every loss token of the E microbatches, divided by their number.

Splitting the ids. `EvalPass.values(split, k, ids)` runs `ids` and returns a vector of 2E
float64 slots, (loss sum, loss tokens) of microbatch j in slots 2j and 2j + 1, zero where this
rank did not run j. The runners of the ids (the data-parallel ranks of a stock run, the live
replicas and their shards under --recover) cover every id exactly once, so summing the vectors
over them leaves in each slot one runner's value plus zeros: exactly that value. A microbatch's
loss is a function of the parameters and the batch alone (every replica holds the same
parameters; eval mode draws no dropout), and the sums over the ids are taken in id order after
the reduction, on every rank. The result is therefore the same, bitwise, however the ids were
split: after a failure the survivors re-split them and get the failure-free value.

The forward step is the user's (pretrain_gpt_recover.py), the same as training's: it sees one
batch and the model and returns the output and its loss function (gpt.py, `one_batch`); the
value is taken from that loss function's (loss sum, token count).

The loss divisor. The schedule divides each returned loss in place, by the patched
`hooks.loss_divisor` (the iteration's B under --recover); an evaluation resets it to megatron's
own (the pass's microbatch count), and the values are copies taken before the division anyway.
"""

import math
from dataclasses import dataclass
from functools import partial

import torch

from megatron_recover.megatron.adapters import devices, hooks, interleaving
from megatron_recover.megatron.adapters.gpt import loss_and_tokens, one_batch


@dataclass
class EvalResult:
    """One evaluation, equal on every rank."""

    split: str  # "valid" or "test"
    evaluation: int  # 1, 2, ... within the split
    iteration: int  # the training iteration it followed
    loss: float  # lm loss: loss sum over loss tokens
    tokens: int

    @property
    def ppl(self) -> float:
        """Megatron-LM's perplexity: exp of the loss, capped at exp(20)."""
        return math.exp(min(20.0, self.loss))

    def line(self, at_end: bool) -> str:
        """Megatron-LM's validation line, between dashes."""
        where = f"iteration {self.iteration}"
        if at_end:
            where += " on validation set" if self.split == "valid" else " on test set"
        text = (f" validation loss at {where} | lm loss value: {self.loss:.6E} |"
                f" lm loss PPL: {self.ppl:.6E} | ")
        rule = "-" * (len(text) + 1)
        return f"{rule}\n{text}\n{rule}"


def result_of(values: torch.Tensor, split: str, evaluation: int, iteration: int) -> EvalResult:
    """The evaluation's value from the summed slot vector, summed in id order."""
    sums = values.view(-1, 2)
    loss_sum, tokens = 0.0, 0.0
    for loss, count in sums.tolist():
        loss_sum += loss
        tokens += count
    return EvalResult(split, evaluation, iteration, loss=loss_sum / max(tokens, 1.0),
                      tokens=int(tokens))


def _eval_loss(user_loss, index, output_tensor):
    """The user's loss function (its loss mask bound) read as (loss sum, token count)."""
    loss_sum, tokens = loss_and_tokens(user_loss(output_tensor))
    # On the device until the pass is done (`EvalPass.values` reads them with one host sync).
    reported = {"index": index, "loss sum": loss_sum.detach(), "tokens": tokens.detach()}
    return loss_sum / tokens.clamp(min=1), reported


class EvalPass:
    """Forward-only passes over evaluation microbatches through megatron's schedule, with the
    user's `forward_step` (the one training runs)."""

    def __init__(self, chunks, source, seq_length: int, micro_batch_size: int, faults,
                 forward_backward, forward_step):
        self.chunks = list(chunks)
        self.forward_step = forward_step
        self.source = source
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.faults = faults
        self.forward_backward = forward_backward

    @property
    def count(self) -> int:
        """Microbatches in one evaluation (E)."""
        return self.source.eval_microbatches

    def splits(self) -> list[str]:
        """The splits --split gives documents, of "valid" and "test"."""
        return [name for name in ("valid", "test") if name in self.source.eval_datasets]

    def values(self, split: str, evaluation: int, iteration: int, ids: list[int],
               reports_loss: bool, padding: int = 0) -> torch.Tensor:
        """The slot vector of `ids` (see the module docstring); zeros where `reports_loss` is
        False (pipeline stages before the last, and TP ranks other than the one that reports).
        `padding` more microbatches run after them and count nothing (expert-parallel ranks
        run passes of one length)."""
        values = torch.zeros(2 * self.count, dtype=torch.float64)
        self.faults.at("evaluation", iteration)
        if not ids and not padding:
            return values
        from megatron.core import parallel_state

        def batches(padding):
            for j in ids:
                yield self.source.eval_microbatch(split, evaluation, j)
            for _ in range(padding):  # reported under no index, so never counted
                yield {**self.source.eval_microbatch(split, evaluation, ids[0] if ids else 0),
                       "index": None}

        hooks.set_loss_divisor(None)  # megatron's own divisor for the forward-only pass
        for chunk in self.chunks:
            chunk.eval()
        try:
            with interleaving.shaped_pass(  # a pass of any length (interleaving.py)
                    self.chunks[0].config, len(ids) + padding,
                    parallel_state.get_pipeline_model_parallel_world_size(),
                    len(self.chunks)) as shaping:
                padding += shaping
                outputs = self.forward_backward(
                    forward_step_func=self._forward_step,
                    data_iterator=[batches(padding) for _ in self.chunks], model=self.chunks,
                    num_microbatches=len(ids) + padding, seq_length=self.seq_length,
                    micro_batch_size=self.micro_batch_size, forward_only=True)
        finally:
            for chunk in self.chunks:
                chunk.train()
        outputs = [out for out in outputs if out["index"] is not None]
        if reports_loss and outputs:  # only the last pipeline stage has them
            pairs = torch.stack([torch.stack([out["loss sum"].double(), out["tokens"].double()])
                                 for out in outputs]).cpu()
            for out, pair in zip(outputs, pairs):
                values[2 * out["index"]:2 * out["index"] + 2] = pair
        return values

    def _forward_step(self, data_iterator, model):
        batch = devices.batch_to_device(next(data_iterator))
        output, user_loss = self.forward_step(one_batch(batch), model)
        return output, partial(_eval_loss, user_loss, batch["index"])
