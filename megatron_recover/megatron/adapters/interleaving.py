"""megatron-core's interleaved pipeline schedule (virtual pipeline stages): which passes it
accepts, and how a pass of any length is made one it accepts.

megatron-core's `forward_backward_pipelining_with_interleaving` (0.16.1 and 0.19.0 alike) runs
M microbatches in groups of N contiguous microbatches per virtual stage, and refuses a pass unless
PP <= N <= M and M mod N is 0 or at least PP. A full pass of a failure-free run is checked at
start-up (arguments.py). Under --recover a pass can be shorter or of another length: an
extension pass, a blocking re-reduction, a replica's share of an evaluation. `shape` says how
such a pass runs:

- M >= PP: with N = M (one group) when the configured N does not fit. A model chunk's
  microbatches run forward and backward in the same order whatever N is, and each chunk
  accumulates into its own gradient buffers, so N changes no gradient bit, only how the chunks
  interleave.
- M < PP: PP - M padding microbatches are appended. A padding microbatch is a real batch with
  its loss mask zeroed: its loss is 0, every gradient it produces is exactly 0, and it is not
  registered in the gradient ledger (the forward step registers every batch it consumes unless
  the batch is padding *and* its loss mask is empty, so a padding batch that could contribute is
  counted and the ledger audit reports the doubled id).
"""

from contextlib import contextmanager


def problem(microbatches: int, group_size: int, pipeline: int) -> str | None:
    """What megatron-core's interleaved schedule says of a pass of `microbatches` with
    `group_size` contiguous microbatches per virtual stage, or None when it accepts it."""
    if not pipeline <= group_size <= microbatches:
        return (f"the number of contiguous micro-batches in a virtual pipeline stage should "
                f"range in [PP={pipeline}, M={microbatches}], got {group_size}")
    remainder = microbatches % group_size
    if 0 < remainder < pipeline:
        return (f"the remainder of M={microbatches} (the micro-batches) divided by "
                f"N={group_size} (contiguous micro-batches in a virtual pipeline stage) should "
                f"be 0, or larger than or equal to the pipeline-parallel size {pipeline}, but "
                f"it is {remainder}")
    return None


def shape(microbatches: int, group_size: int, pipeline: int) -> tuple[int, int]:
    """(padding microbatches to append, group size to run with) for a pass of `microbatches`
    (at least 1) under the configured `group_size`: the configured one whenever it fits."""
    total = max(microbatches, pipeline)
    if problem(total, group_size, pipeline) is None:
        return total - microbatches, group_size
    return total - microbatches, total


@contextmanager
def shaped_pass(config, microbatches: int, pipeline: int, chunks: int):
    """Around one call of megatron's schedule over `microbatches` with `chunks` model chunks
    per rank: yields the padding microbatches to append, and runs the pass with the group size
    `shape` chose in megatron's `config` (the configured one is restored after)."""
    configured = config.microbatch_group_size_per_vp_stage
    padding, group_size = (0, configured) if chunks == 1 else shape(microbatches, configured,
                                                                   pipeline)
    config.microbatch_group_size_per_vp_stage = group_size
    try:
        yield padding
    finally:
        config.microbatch_group_size_per_vp_stage = configured
