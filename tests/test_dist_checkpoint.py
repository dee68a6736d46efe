"""Stock checkpoint-restart (megatron-core distributed checkpoints): a run resumed from a
checkpoint continues exactly as the uninterrupted run.

Run: `make test`. CPU only; 4 oversubscribed ranks without --recover, each run under a hard
timeout. Dropout is on, so the RNG states must travel with the checkpoint too.
"""

import shutil

import pytest

from megatron_recover.launch import LaunchConfig, launch
from megatron_recover.megatron.persistence import torch_dist as dist_checkpoint, loading
from tests.mpirun_harness import ENTRY
from tests.training_harness import megatron_lm_lines

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
TIMEOUT_S = 240
RANKS = 4
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--eval-iters", "0",
       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
       "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-2", "--mock-data",
       # 129 ids pad to 256 rows at TP=1 and TP=2 alike (Megatron-LM pads to a multiple of
       # 128 x TP), so a checkpoint resharded between them keeps its output layer's softmax.
       "--tokenizer-type", "NullTokenizer", "--vocab-size", "129", "--log-interval", "1",
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
    # The resumed launch's second line averages its first iteration in again (Megatron-LM's
    # first line starts no interval), as megatron_lm_lines says.
    assert resumed[5] == losses[5]
    assert resumed[6] == pytest.approx(megatron_lm_lines({5: losses[5], 6: losses[6]})[6],
                                       rel=1e-6)
    assert len(digests) == 1 and resumed_digests == digests  # bitwise-equal parameters


@pytest.mark.long  # make test runs the same flags under --recover (tests/test_checkpoint.py)
@pytest.mark.timeout(5 * TIMEOUT_S)
def test_megatron_load_flags(tmp_path):
    """--ckpt-step, --no-load-rng, --no-load-optim and --pretrained-checkpoint (a fine-tune)
    against a 4-iteration run that saved at 2 and 4 (2 ranks, dropout on, the distributed
    optimizer, --async-save). Each flag's effect is what changes: iteration 3's loss is computed before its
    optimizer step, so it equals the uninterrupted run's exactly when the parameters, data and
    dropout generators were loaded; the distributed optimizer's state makes the resumed run's
    final parameters bitwise equal."""
    save = tmp_path / "ckpt"
    four = ["--train-iters", "4", "--use-distributed-optimizer"]
    # Saved with --async-save: the resumes below read what the forked writers wrote while
    # training went on.
    output, losses, digests = stock_run(tmp_path, "full", [*four, "--save", str(save),
                                                           "--save-interval", "2",
                                                           "--async-save"], ranks=2)
    assert output.count("scheduled an async checkpoint save at iteration") == 2
    assert loading.tracked_iteration(save) == 4
    from_2 = ["--load", str(save), "--ckpt-step", "2", *four]
    output, whole, whole_digests = stock_run(tmp_path, "whole", from_2, ranks=2)
    assert "at iteration       2" in output and sorted(whole) == [3, 4]
    assert whole[3] == losses[3] and whole_digests == digests
    assert whole[4] == pytest.approx(megatron_lm_lines({3: losses[3], 4: losses[4]})[4],
                                     rel=1e-6)
    _, no_rng, _ = stock_run(tmp_path, "no-rng", [*from_2, "--no-load-rng"], ranks=2)
    assert no_rng[3] != losses[3]  # other dropout masks
    _, no_optim, no_optim_digests = stock_run(tmp_path, "no-optim", [*from_2, "--no-load-optim"],
                                              ranks=2)
    assert no_optim[3] == losses[3] and no_optim_digests != digests  # fresh Adam and schedule
    output, tuned, _ = stock_run(tmp_path, "finetune",
                                 ["--load", str(tmp_path / "empty"), "--pretrained-checkpoint",
                                  str(save), "--train-iters", "2", "--use-distributed-optimizer"],
                                 ranks=2)
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
    # A torn shard file (one rank's writes cut short) stops every rank before training with
    # that reason, not as another model, and the directory is left as it was.
    torn = tmp_path / "torn"
    shutil.copytree(save, torn)
    victim = sorted((torn / "iter_0000002").glob("*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    before = {p: p.read_bytes() for p in torn.rglob("*") if p.is_file()}
    result = launch(LaunchConfig(2, [*ENTRY, *JOB, "--load", str(torn), "--ckpt-step", "2",
                                     *four], tmp_path / "torn-run", TIMEOUT_S))
    assert not result.timed_out and {s.get("state") for s in result.statuses.values()} == {
        "error"}, result.output[-3000:]
    assert (f"--load: {torn / 'iter_0000002'} cannot be read (EOFError); a torn or partial "
            "checkpoint?") in result.output and "lm loss:" not in result.output
    assert {p: p.read_bytes() for p in torn.rglob("*") if p.is_file()} == before
    print(f"iteration 3: uninterrupted {losses[3]}, --no-load-rng {no_rng[3]}, --no-load-optim "
          f"{no_optim[3]}; fine-tune iteration 1 {tuned[1]} against {losses[1]}")


def test_load_refuses_a_recover_checkpoint(tmp_path):
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / "mp_rank_00_000.pt").write_bytes(b"")
    (tmp_path / dist_checkpoint.TRACKER).write_text("2\n")
    with pytest.raises(ValueError, match="not a megatron-core distributed"):
        dist_checkpoint.check_loadable(tmp_path)


# make test's budget: in make test-long (test_megatron_load_flags resumes the distributed
# optimizer bitwise in make test).
@pytest.mark.long
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_distributed_optimizer_resumes_and_reshards(tmp_path):
    """--use-distributed-optimizer saves its per-bucket state (Megatron-LM's dp_reshardable
    format): a relaunch on the same 2 ranks continues bitwise; one on 4 ranks (the state cut
    into 4 shards instead of 2) continues within the reduction-order tolerance."""
    save = tmp_path / "ckpt"
    optimizer = ["--use-distributed-optimizer", "--hidden-dropout", "0",
                 "--attention-dropout", "0", "--train-iters", "4"]
    _, losses, digests = stock_run(tmp_path, "full", [*optimizer, "--save", str(save),
                                                      "--save-interval", "2"], ranks=2)
    assert (loading.iteration_dir(save, 2) / "metadata.json").is_file()
    (save / dist_checkpoint.TRACKER).write_text("2\n")
    output, same, same_digests = stock_run(tmp_path, "same", [*optimizer, "--load", str(save)],
                                           ranks=2)
    assert "at iteration       2" in output and sorted(same) == [3, 4]
    expected = megatron_lm_lines({3: losses[3], 4: losses[4]})  # the resumed launch's lines
    assert same[3] == losses[3] and same[4] == pytest.approx(expected[4], rel=1e-6)
    assert same_digests == digests
    _, more, _ = stock_run(tmp_path, "more", [*optimizer, "--load", str(save)])
    assert sorted(more) == [3, 4]
    rdiff = max(abs(more[t] - expected[t]) / abs(expected[t]) for t in (3, 4))
    print(f"uninterrupted {[losses[3], losses[4]]}, on 4 ranks {[more[3], more[4]]}: largest "
          f"relative difference {rdiff:.2e}")
    assert rdiff < 1e-5


@pytest.mark.timeout(4 * TIMEOUT_S)
def test_stock_and_recover_checkpoints_load_each_other_resharded(tmp_path):
    """One format both ways, across layouts: a stock run at TP=2 x PP=2 saves iteration 2; a
    stock run at TP=1 x PP=1 resumes it for one iteration; a --recover run of 2 replicas at TP=1 x PP=1 resumes it (both model-parallel sizes resharded)
    and saves iteration 4; a stock run of 2 data-parallel ranks resumes that. Each continues
    the first run's trajectory within the tolerance of another reduction order. Dropout is off:
    stock runs draw it in sequence, --recover per microbatch."""
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    stock_ckpt, recover_ckpt = tmp_path / "stock-ckpt", tmp_path / "recover-ckpt"
    _, reference, _ = stock_run(tmp_path, "stock", [
        *no_dropout, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--save", str(stock_ckpt), "--save-interval", "2"])
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    # The stock run's own checkpoint at TP=1 x PP=1 in a stock run (one iteration: it is the
    # same load as the --recover run's below).
    output, stock_tp1, _ = stock_run(tmp_path, "stock-tp1", [
        *no_dropout, "--load", str(stock_ckpt), "--ckpt-step", "2", "--exit-interval", "3"],
        ranks=2)
    assert "at iteration       2" in output and "RNG state will be ignored" in output
    assert sorted(stock_tp1) == [3]
    output, recovered, _ = stock_run(tmp_path, "recover", [
        *no_dropout, "--recover", "--load", str(stock_ckpt), "--ckpt-step", "2",
        "--save", str(recover_ckpt), "--save-interval", "2", "--exit-interval", "4"], ranks=2)
    assert "resumed iteration 2" in output and "RNG state will be ignored" in output
    assert sorted(recovered) == [3, 4]
    assert (recover_ckpt / "iter_0000004" / "metadata.json").is_file()
    output, resumed, _ = stock_run(tmp_path, "stock-again", [
        *no_dropout, "--load", str(recover_ckpt)], ranks=2)
    assert "at iteration       4" in output and sorted(resumed) == [5, 6]
    # Both hold Megatron-LM's common keys, with the data position its loader takes.
    from megatron.core.dist_checkpointing import load_common_state_dict

    for path, iteration in ((stock_ckpt / "iter_0000002", 2), (recover_ckpt / "iter_0000004", 4)):
        common = load_common_state_dict(str(path))
        assert {"args", "checkpoint_version", "iteration", "opt_param_scheduler",
                "num_floating_point_operations_so_far"} <= set(common)
        assert common["iteration"] == iteration and common["checkpoint_version"] == 3.0
        assert common["args"].consumed_train_samples == 8 * iteration
    continued = {**recovered, **resumed}
    # What two launches resuming at 2 and at 4 print of the uninterrupted run's losses (each
    # launch's second line averages its first iteration in again).
    expected = {**megatron_lm_lines({t: reference[t] for t in (3, 4)}),
                **megatron_lm_lines({t: reference[t] for t in (5, 6)})}
    rdiff = max(abs(continued[t] - expected[t]) / abs(expected[t]) for t in range(3, 7))
    print(f"uninterrupted TP=2 x PP=2 {[reference[t] for t in range(3, 7)]}, continued "
          f"{[continued[t] for t in range(3, 7)]}, stock at TP=1 {stock_tp1[3]}: largest "
          f"relative difference {rdiff:.2e}")
    assert rdiff < 1e-5 and abs(stock_tp1[3] - reference[3]) / abs(reference[3]) < 1e-5
