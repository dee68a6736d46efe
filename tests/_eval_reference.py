"""The loss of saved parameters on a split's samples, computed the plain way (one process, no
schedule).

Started by tests/test_evaluation_logging.py:

    python tests/_eval_reference.py PARAMS ARGS_JSON WHICH OUT_JSON

PARAMS: a rank's final parameters by name (`run.save_parameters`); ARGS_JSON: the run's
pretrain_gpt_recover.py arguments (mock data, TP = PP = 1); WHICH: `K`, evaluation K of the
validation split (1, 2, ...), or `train:T`, the global batch of training iteration T. It builds
the split with megatron-core's dataset builder at the size Megatron-LM gives it (training:
train_iters x GBS samples; validation: (train_iters // eval_interval + 1) x eval_iters x GBS),
takes that batch's samples in order (evaluation K: eval_iters x GBS of them; iteration T: GBS),
runs each through the GPTModel in eval mode and writes {"loss": sum of token losses / loss
tokens, "tokens": loss tokens} to OUT_JSON. Nothing of megatron_recover's evaluation, schedule
or data addressing is used.
"""

import json
import sys
import tempfile

import torch


def main(params_path, args_path, which, out_path):
    from megatron_recover.testing import enable_cpu_emulation

    enable_cpu_emulation()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    from megatron_recover.megatron.config import arguments, mcore_config
    from megatron_recover.megatron.adapters.gpt import build_gpt
    from megatron_recover.megatron.data.tokenizers import build_tokenizer

    cfg = arguments.parse_args(json.loads(open(args_path).read()), world_size=1,
                               cuda_available=False)
    with tempfile.TemporaryDirectory() as store:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}/store",
                                             rank=0, world_size=1)
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        tokenizer = build_tokenizer("NullTokenizer", vocab_size=cfg.data.vocab_size)
        model = build_gpt(mcore_config.to_transformer_config(cfg),
                          mcore_config.padded_vocab_size(cfg, tokenizer.vocab_size), cfg.model)
        saved = torch.load(params_path)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(saved[name])
        model.eval()

        gbs, iters = cfg.global_batch_size, cfg.evaluation.iters
        interval = cfg.evaluation.interval
        valid_samples = ((cfg.train_iters // interval if interval else 0) + 1) * iters * gbs
        dataset_config = GPTDatasetConfig(random_seed=cfg.seed, sequence_length=cfg.model.seq_length,
                                          blend=None, split=cfg.data.split, tokenizer=tokenizer,
                                          reset_position_ids=False, reset_attention_mask=False,
                                          eod_mask_loss=cfg.data.eod_mask_loss)
        train, valid, _ = BlendedMegatronDatasetBuilder(
            MockGPTDataset, [cfg.train_iters * gbs, valid_samples, iters * gbs], lambda: True,
            dataset_config).build()
        if which.startswith("train:"):
            dataset, first, count = train, (int(which[6:]) - 1) * gbs, gbs
        else:
            dataset, first, count = valid, (int(which) - 1) * iters * gbs, iters * gbs
        loss_sum = tokens = 0.0
        sample_means = []
        with torch.no_grad():
            for index in range(first, first + count):
                sample = dataset[index]
                losses = model(sample["tokens"][None], sample["position_ids"][None], None,
                               labels=sample["labels"][None])
                mask = sample["loss_mask"].float().view(-1)
                loss_sum += float(torch.sum(losses.float().view(-1) * mask))
                tokens += float(mask.sum())
                sample_means.append(float(torch.sum(losses.float().view(-1) * mask) / mask.sum()))
        torch.distributed.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump({"loss": loss_sum / tokens, "tokens": tokens,
                   "mean of sample means": sum(sample_means) / len(sample_means)}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])
