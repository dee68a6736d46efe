"""The model options of Megatron-LM's Llama-style scripts under --recover, in fp32 where "exact"
means within EXACT_RTOL: sequence parallelism with TP=2, zero-centred norms
(--apply-layernorm-1p), query/key norms, --kv-channels, full activation recomputation and a
decoupled learning rate for the embedding and output layer, with a replica failure inside a
gradient reduction.

Run: `make test`. CPU only; 4 oversubscribed ranks (TP=2 x DP=2) per run, each under a hard
timeout. Each option is shown to have taken effect in the parameters the ranks wrote: sequence
parallelism by the two tensor-parallel ranks holding bitwise-equal norm weights (each saw half of
every sequence, so without the sum over the tensor-parallel group they would differ), the others
by names, shapes and values.
"""

import pytest
import torch

from tests.training_harness import STABLE_LR, assert_exact, assert_ledger_held, run_training

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
TIMEOUT_S = 240
ITERATIONS = 4
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--eval-iters", "0",
       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
       "--global-batch-size", "8", "--train-iters", str(ITERATIONS), *STABLE_LR,
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--log-interval", "1", "--tensor-model-parallel-size", "2",
       "--sequence-parallel", "--apply-layernorm-1p", "--normalization", "RMSNorm",
       # A key norm's bias gets no gradient (softmax ignores a constant added to every key), so
       # RMSNorm, as in Llama-style models, keeps every compared tensor above rounding noise.
       "--qk-layernorm", "--kv-channels", "16",
       "--recompute-granularity", "full", "--recompute-method", "uniform",
       "--recompute-num-layers", "1", "--decoupled-lr", "6e-3", "--decoupled-min-lr", "1e-3"]


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_llama_style_model_options_exact_with_a_failure(tmp_path):
    reference = run_training(tmp_path / "reference", 4, JOB, None, TIMEOUT_S)
    schedule = "entries:\n  - {iteration: 2, replica: 1, local_rank: 0, location: during-reduce}\n"
    run = run_training(tmp_path / "failure", 4, JOB, schedule, TIMEOUT_S)
    assert [(m["rank"], m["location"]) for m in run.markers] == [(2, "during-reduce")]
    assert run.completed() == [0, 1]
    assert [r["iteration"] for r in run.records] == list(range(1, ITERATIONS + 1))
    assert_ledger_held(run.records, 8)
    assert run.records[-1]["live_replicas"] == 1
    assert_exact(run, reference, "TP=2 sequence parallel, 1p, qk norm, recompute, decoupled lr")

    tp0, tp1 = run.params(0), run.params(1)
    norms = [name for name in tp0 if "layernorm" in name]
    assert any("q_layernorm" in n for n in norms) and any("k_layernorm" in n for n in norms)
    for name in norms:
        assert torch.equal(tp0[name], tp1[name]), f"{name} differs across the TP pair"
        if "_layernorm" in name and "q_" not in name and "k_" not in name:
            # zero-centred: stored as gamma - 1, started at 0, moved by at most a few lr steps
            assert tp0[name].abs().max() < 0.1, name
    qkv = tp0["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (3 * 4 * 16 // 2, 32)  # (q, k, v) x heads x kv-channels / TP
