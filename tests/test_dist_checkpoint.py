"""Stock checkpoint-restart (megatron-core distributed checkpoints): a run resumed from a
checkpoint continues exactly as the uninterrupted run.

Run: `make test`. CPU only; 4 oversubscribed ranks without --recover, each run under a hard
timeout. Dropout is on, so the RNG states must travel with the checkpoint too.
"""

import shutil
from types import SimpleNamespace

import pytest

from megatron_recover.launch import LaunchConfig, launch
from megatron_recover.megatron import dist_checkpoint, loading
from tests.mpirun_harness import ENTRY

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
TIMEOUT_S = 240
RANKS = 4
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--eval-iters", "0",
       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
       "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-2", "--mock-data",
       "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--log-interval", "1",
       "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def stock_run(tmp_path, name, extra, ranks=RANKS):
    result = launch(LaunchConfig(ranks, [*ENTRY, *JOB, *extra], tmp_path / name, TIMEOUT_S))
    assert not result.timed_out and result.succeeded, result.output[-4000:]
    losses = {int(line.split("/")[0].split()[-1]): float(line.split("lm loss:")[1].split("|")[0])
              for line in result.output.splitlines() if "lm loss:" in line}
    digests = {s["param_digest"] for s in result.statuses.values()}
    return result.output, losses, digests


# make test's budget: in make test-long (test_checkpoint.py resumes a --recover run in make test).
@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_resume_from_checkpoint_continues_the_run(tmp_path):
    save = tmp_path / "ckpt"
    output, losses, digests = stock_run(tmp_path, "full",
                                        ["--save", str(save), "--save-interval", "2",
                                         "--load", str(save)])
    assert f"no checkpoint in {save}" in output
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert loading.tracked_iteration(save) == 6
    assert all((loading.iteration_dir(save, i) / "metadata.json").is_file()
               for i in (2, 4, 6))
    # The job died after iteration 4 was checkpointed: the tracker names it.
    resume = tmp_path / "resume"
    shutil.copytree(save, resume)
    (resume / dist_checkpoint.TRACKER).write_text("4\n")
    output, resumed, resumed_digests = stock_run(tmp_path, "resumed", ["--load", str(resume)])
    assert "at iteration       4" in output
    assert sorted(resumed) == [5, 6]
    print(f"uninterrupted {[losses[5], losses[6]]}, resumed {[resumed[5], resumed[6]]}")
    assert [resumed[5], resumed[6]] == [losses[5], losses[6]]
    assert len(digests) == 1 and resumed_digests == digests  # bitwise-equal parameters


@pytest.mark.timeout(5 * TIMEOUT_S)
def test_megatron_load_flags(tmp_path):
    """--ckpt-step, --no-load-rng, --no-load-optim and --pretrained-checkpoint (a fine-tune)
    against a 4-iteration run that saved at 2 and 4 (2 ranks, dropout on). Each flag's effect
    is what changes: iteration 3's loss is computed before its optimizer step, so it equals the
    uninterrupted run's exactly when the parameters, data and dropout generators were loaded."""
    save = tmp_path / "ckpt"
    four = ["--train-iters", "4"]
    _, losses, digests = stock_run(tmp_path, "full", [*four, "--save", str(save),
                                                      "--save-interval", "2"], ranks=2)
    from_2 = ["--load", str(save), "--ckpt-step", "2", *four]
    output, whole, whole_digests = stock_run(tmp_path, "whole", from_2, ranks=2)
    assert "at iteration       2" in output and sorted(whole) == [3, 4]
    assert [whole[3], whole[4]] == [losses[3], losses[4]] and whole_digests == digests
    _, no_rng, _ = stock_run(tmp_path, "no-rng", [*from_2, "--no-load-rng"], ranks=2)
    assert no_rng[3] != losses[3]  # other dropout masks
    _, no_optim, no_optim_digests = stock_run(tmp_path, "no-optim", [*from_2, "--no-load-optim"],
                                              ranks=2)
    assert no_optim[3] == losses[3] and no_optim_digests != digests  # fresh Adam and schedule
    output, tuned, _ = stock_run(tmp_path, "finetune",
                                 ["--load", str(tmp_path / "empty"), "--pretrained-checkpoint",
                                  str(save), "--train-iters", "2"], ranks=2)
    assert "fine-tuning from --pretrained-checkpoint" in output
    assert "(fine-tuning from iteration 1)" in output and sorted(tuned) == [1, 2]
    assert tuned[1] != losses[1]  # the same data and dropout, the trained model
    # Another model shape stops before training, saying so (megatron-core's loader names the
    # tensor and both shapes).
    result = launch(LaunchConfig(2, [*ENTRY, *JOB, *from_2, "--hidden-size", "64"],
                                 tmp_path / "hidden", TIMEOUT_S))
    assert not result.timed_out and "megatron-recover: error: --load: the model in" in (
        result.output), result.output[-3000:]
    assert {s.get("state") for s in result.statuses.values()} == {"error"}
    print(f"iteration 3: uninterrupted {losses[3]}, --no-load-rng {no_rng[3]}, --no-load-optim "
          f"{no_optim[3]}; fine-tune iteration 1 {tuned[1]} against {losses[1]}")


def test_load_refuses_a_recover_checkpoint(tmp_path):
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / "mp_rank_00_000.pt").write_bytes(b"")
    (tmp_path / dist_checkpoint.TRACKER).write_text("2\n")
    with pytest.raises(ValueError, match="not a megatron-core distributed"):
        dist_checkpoint.check_loadable(tmp_path)


def test_start_refuses_the_distributed_optimizer():
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(save="ckpt", load=None),
                          parallel=SimpleNamespace(use_distributed_optimizer=True))
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        dist_checkpoint.check_start(cfg)
    cfg.checkpoint.save = None
    dist_checkpoint.check_start(cfg)  # no checkpointing asked: nothing to refuse
