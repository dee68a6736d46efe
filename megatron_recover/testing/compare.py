"""How a run is compared with its failure-free reference: the measures behind "exact".

A non-finite loss or parameter compares as an infinite difference: `max` over floats would
otherwise drop a NaN (every comparison with it is false) and report the finite rest.

Shared by the tests (tests/training_harness.py) and the fault campaign (faults/campaign.py), so
both hold runs to the same definition.
"""

import math

# The tests' learning-rate settings, slow enough that the failure-free dynamics are not chaotic:
# reduction-order noise (~1e-8) stays ~1e-8 over a few iterations instead of growing to 1e-5 as it
# does at 3e-2. No linear biases: the key part of the QKV bias has no true gradient (softmax
# ignores a shift of every key), so its gradient is pure rounding noise, which Adam turns into
# lr-sized steps. Adam's eps at 1e-4 keeps it from doing the same to the few weights whose
# gradients nearly cancel (final parameters 1.5-2e-7 apart after a recovery at eps 1e-4 and 1e-3,
# 1-4e-6 at 1e-8 and 1e-6).
STABLE_LR = ["--lr", "3e-3", "--clip-grad", "1.0", "--disable-bias-linear", "--adam-eps", "1e-4"]
EXACT_RTOL = 1e-6  # fp32: relative loss per iteration, and final parameters


def loss_rdiff(records: list[dict], reference: list[dict]) -> float:
    """Max relative loss difference over the iterations, which must be the same ones."""
    if [r["iteration"] for r in records] != [r["iteration"] for r in reference]:
        raise ValueError("the runs committed different iterations")
    return max(_finite(abs(r["loss"] - ref["loss"]) / abs(ref["loss"]))
               for r, ref in zip(records, reference))


def _finite(diff: float) -> float:
    return diff if math.isfinite(diff) else math.inf


def param_rdiff(params: dict, reference: dict) -> float:
    """Max over tensors of max |a - b| / max |b|, in fp32 whatever the precision; a tensor that
    is zero in the reference counts its absolute difference (never 0/0)."""
    if params.keys() != reference.keys():
        raise ValueError("the runs hold different parameters")
    worst = 0.0
    for name, ref in reference.items():
        ref = ref.float()
        diff = float((params[name].float() - ref).abs().max())
        scale = float(ref.abs().max())
        worst = max(worst, _finite(diff / scale if scale > 0 else diff))
    return worst
