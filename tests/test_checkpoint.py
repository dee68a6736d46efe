"""Checkpoints under --recover as Megatron users run them: a checkpoint written after replica 0
died resumes on fewer replicas; a job script's `--save d --load d` with an empty `d` starts from
scratch, saves at the end, and its relaunch continues the uninterrupted run (DP, TP, and
distributed-optimizer instances, whose Adam moments megatron's state_dict leaves out).

Run: `make test`. CPU only; 2-4 oversubscribed ranks, each run under a hard timeout.
"""

import json
import shutil

import pytest
import torch

from megatron_recover.launch import LaunchConfig, launch
from tests.mpirun_harness import ENTRY
from tests.training_harness import (
    EXACT_LOSS_RTOL,
    EXACT_PARAM_RTOL,
    STABLE_LR,
    loss_rdiff,
    param_rdiff,
)

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]
TIMEOUT_S = 240
JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--eval-iters", "0",
       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
       "--global-batch-size", "12", *STABLE_LR, "--lr-decay-iters", "8",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--log-interval", "1", "--recover"]


def train(run_dir, ranks, extra):
    run_dir.mkdir()
    log = run_dir / "log.jsonl"
    result = launch(LaunchConfig(ranks, [*ENTRY, *JOB, "--recover-log", str(log), *extra],
                                 run_dir / "status", TIMEOUT_S))
    assert not result.timed_out and result.succeeded, result.output[-4000:]
    return result, {r["iteration"]: r for r in map(json.loads, log.read_text().splitlines())}


def params_rdiff(run_dir, reference_dir, ranks):
    return max(param_rdiff(torch.load(run_dir / "status" / f"rank-{r}.params.pt"),
                           torch.load(reference_dir / "status" / f"rank-{r}.params.pt"))
               for r in ranks)


@pytest.mark.timeout(4 * TIMEOUT_S)
def test_a_save_after_failures_and_a_kill_during_the_next_resume_exactly(tmp_path):
    """torch_dist (Megatron-LM's default format) under --recover with --async-save, 3 replicas:
    replica 0 dies in iteration 2's reduction, so replicas 1 and 2 save iteration 2's
    checkpoint, the replicated tensors spread over them; replica 1 dies inside iteration 4's
    save, after its shards are on disk and before the tracker names them. The tracker must
    still name iteration 2, and relaunches from it on the survivors' count (2) and on the
    original count (3) continue the uninterrupted run."""
    _, reference = train(tmp_path / "reference", 3, ["--train-iters", "8"])
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("entries:\n"
                        "  - {iteration: 2, replica: 0, local_rank: 0, location: during-reduce}\n"
                        "  - {iteration: 4, replica: 1, local_rank: 0, location: checkpoint-save}\n")
    ckpt = tmp_path / "ckpt"
    # The run of the reference, stopped after iteration 4 (a shorter --train-iters would be
    # another schedule, whose checkpoint Megatron-LM's scheduler check refuses to resume).
    result, first = train(tmp_path / "first", 3, [
        "--train-iters", "8", "--exit-interval", "4", "--save", str(ckpt), "--save-interval", "2",
        "--recover-failure-schedule", str(schedule), "--async-save"])
    # --async-save: each save is scheduled, written by a forked process, and completed later
    # (iteration 4's completion is where its writer dies).
    assert result.output.count("scheduled an async checkpoint save at iteration") == 2
    assert result.output.count("successfully saved checkpoint from iteration") == 1
    assert ("megatron-recover: the checkpoint in flight is not complete: a rank failed during "
            "the save") in result.output  # replica 2, the other saver, went on to the end
    markers = [json.loads(line) for line in
               (tmp_path / "first/log.markers.jsonl").read_text().splitlines()]
    assert [(m["rank"], m["iteration"], m["location"]) for m in markers] == [
        (0, 2, "during-reduce"), (1, 4, "checkpoint-save")]  # both faults fired
    assert first[4]["live_replicas"] == 2
    assert (ckpt / "iter_0000002" / "metadata.json").is_file()  # a torch_dist checkpoint
    # Both live replicas wrote: replicated tensors are spread over them (file __R_N.distcp is
    # rank R's of the 2 savers), each about half of the bytes.
    written = {}
    for part in (ckpt / "iter_0000002").glob("__*.distcp"):
        saver = int(part.name.split("_")[2])
        written[saver] = written.get(saver, 0) + part.stat().st_size
    print(f"iteration 2's checkpoint: bytes written per saver {written}")
    assert sorted(written) == [0, 1] and max(written.values()) < 0.7 * sum(written.values())
    state = json.loads((ckpt / "iter_0000002/recover_state.json").read_text())
    assert state["live_replicas"] == [1, 2] and state["b"] == 12 and state["w_init"] == 3
    assert (ckpt / "iter_0000004").is_dir()  # written, never named
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    # Every replica holds the same parameters: compare each resumed rank with reference rank 0.
    expected = torch.load(tmp_path / "reference" / "status" / "rank-0.params.pt")
    for replicas in (2, 3):
        name = f"resumed-{replicas}"
        result, resumed = train(tmp_path / name, replicas,
                                ["--train-iters", "8", "--load", str(ckpt)])
        assert "resumed iteration 2" in result.output
        assert sorted(resumed) == [3, 4, 5, 6, 7, 8]
        assert all(r["contributions"] == 12 and r["invariant_ok"] for r in resumed.values())
        assert resumed[3]["live_replicas"] == replicas
        loss = loss_rdiff([resumed[t] for t in sorted(resumed)],
                          [reference[t] for t in sorted(resumed)])
        params = max(param_rdiff(torch.load(tmp_path / name / "status" / f"rank-{r}.params.pt"),
                                 expected) for r in range(replicas))
        print(f"resumed on {replicas} replicas: max relative loss diff {loss:.2e}, "
              f"final parameters {params:.2e}")
        assert loss <= EXACT_LOSS_RTOL, loss
        assert params <= EXACT_PARAM_RTOL, params


LAYOUTS = {
    "dp": (3, []),
    "tp2xdp2": (4, ["--tensor-model-parallel-size", "2"]),
    "do-2x2": (4, ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]),
    "do-2x2-torch": (4, ["--use-distributed-optimizer", "--num-distributed-optimizer-instances",
                         "2", "--ckpt-format", "torch"]),
}


@pytest.mark.long
@pytest.mark.timeout(4 * TIMEOUT_S)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_job_script_save_and_load_the_same_directory(tmp_path, layout, figures):
    """Megatron-LM's job-script form: every launch passes `--save d --load d` (torch_dist, and
    the distributed-optimizer instances also in the torch format)."""
    ranks, extra = LAYOUTS[layout]
    _, reference = train(tmp_path / "reference", ranks, [*extra, "--train-iters", "8"])
    ckpt = tmp_path / "ckpt"
    same_dir = ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "3"]
    result, first = train(tmp_path / "first", ranks,
                          [*extra, *same_dir, "--train-iters", "8", "--exit-interval", "4"])
    assert "holds no checkpoint" in result.output and "training from scratch" in result.output
    assert sorted(first) == [1, 2, 3, 4]
    # Every --save-interval iterations and once more at the --exit-interval stop, as
    # Megatron-LM does.
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    files = sorted(str(p.relative_to(ckpt / "iter_0000004"))
                   for p in (ckpt / "iter_0000004").rglob("*.pt"))
    if not layout.endswith("-torch"):
        assert (ckpt / "iter_0000004" / "metadata.json").is_file()  # torch_dist, the default
    else:
        # Megatron-LM's files: the shards' state gathered into one distrib_optim.pt per position,
        # megatron-core's get_parameter_state_dp_zero dict (one gradient buffer, fp32 here). Its
        # main parameters are the trained model's values (with the buffer's alignment padding).
        assert files == ["mp_rank_00/distrib_optim.pt", "mp_rank_00/model_optim_rng.pt"]
        saved = torch.load(ckpt / "iter_0000004" / files[0])
        assert saved["buckets_coalesced"] is True and set(saved) == {"buckets_coalesced", 0}
        ((dtypes, state),) = saved[0].items()
        assert dtypes == (torch.float32, torch.float32)
        assert {k: v.shape for k, v in state.items() if k != "numel_unpadded"} == {
            k: (state["numel_unpadded"],) for k in ("param", "exp_avg", "exp_avg_sq")}
        trained = torch.cat([p.flatten() for p in torch.load(
            tmp_path / "first/status/rank-0.params.pt").values()])
        assert torch.equal(state["param"][state["param"] != 0].sort().values,
                           trained[trained != 0].sort().values)
        assert float(state["exp_avg_sq"].abs().sum()) > 0  # stepped

    result, resumed = train(tmp_path / "resumed", ranks, [*extra, *same_dir, "--train-iters", "8"])
    assert "resumed iteration 4" in result.output
    assert sorted(resumed) == [5, 6, 7, 8]
    loss = loss_rdiff([resumed[t] for t in sorted(resumed)],
                      [reference[t] for t in sorted(resumed)])
    params = params_rdiff(tmp_path / "resumed", tmp_path / "reference", range(ranks))
    figures.append(f"checkpoint {layout}: --save d --load d relaunch vs uninterrupted: loss "
                   f"{loss:.2e}, parameters {params:.2e}")
    assert loss <= EXACT_LOSS_RTOL and params <= EXACT_PARAM_RTOL
    if layout.endswith("-torch"):
        # distrib_optim.pt loads on another number of shards: the same 2 replicas, unsharded.
        result, resharded = train(tmp_path / "resharded", 2, [
            "--use-distributed-optimizer", "--ckpt-format", "torch", "--train-iters", "8",
            "--load", str(ckpt), "--ckpt-step", "4"])
        assert "resumed iteration 4" in result.output and sorted(resharded) == [5, 6, 7, 8]
        loss = loss_rdiff([resharded[t] for t in sorted(resharded)],
                          [reference[t] for t in sorted(resharded)])
        figures.append(f"checkpoint {layout}: resumed on 1 shard per replica: loss {loss:.2e}")
        assert loss <= EXACT_LOSS_RTOL
        # A torn distrib_optim.pt stops every shard at start-up (the one reading it says why;
        # none waits in megatron's scatter), and the file is left as it was.
        victim = ckpt / "iter_0000004" / "mp_rank_00" / "distrib_optim.pt"
        victim.write_bytes(victim.read_bytes()[:1000])
        result = launch(LaunchConfig(ranks, [*ENTRY, *JOB, *extra, "--train-iters", "8",
                                             "--load", str(ckpt), "--ckpt-step", "4"],
                                     tmp_path / "torn" / "status", TIMEOUT_S))
        assert not result.timed_out and not result.succeeded
        assert f"--load: {victim} cannot be read" in result.output, result.output[-3000:]
        assert victim.stat().st_size == 1000


# What Megatron-LM's load_checkpoint reads from model_optim_rng.pt (megatron/training/
# checkpointing.py at core_v0.16.1, docs/checkpoints.md), and our recovery state.
MEGATRON_LM_FILE_KEYS = {"args", "checkpoint_version", "iteration", "model", "optimizer",
                         "opt_param_scheduler", "rng_state", "num_floating_point_operations_so_far"}
MEGATRON_LM_RNG_NAMES = {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
                         "rng_tracker_states"}


@pytest.mark.timeout(5 * TIMEOUT_S)
def test_megatron_load_flags_under_recover(tmp_path):
    """--ckpt-format torch in Megatron-LM's layout (2 replicas). The files hold Megatron-LM's keys
    and the model's own state-dict keys and shapes; a copy stripped of our recovery state and
    given a whole argument namespace (as Megatron-LM itself writes) resumes
    exactly. --ckpt-step with --no-load-optim: iteration 3's loss comes before its optimizer
    step, so it equals the uninterrupted run's when the parameters were loaded, whatever the
    optimizer; the step then differs (fresh Adam moments and schedule). A fine-tune starts at
    iteration 1 with the trained model."""
    import argparse

    import megatron.core  # noqa: F401  (registers argparse.Namespace with torch.load's safe types)

    from megatron_recover.megatron.config.arguments import build_parser

    ckpt = tmp_path / "ckpt"
    four = ["--train-iters", "4", "--save-interval", "2", "--ckpt-format", "torch"]
    _, full = train(tmp_path / "full", 2, [*four, "--save", str(ckpt)])
    (position,) = [p for p in (ckpt / "iter_0000002").iterdir() if p.is_dir()]
    assert position.name == "mp_rank_00"
    saved = torch.load(position / "model_optim_rng.pt")
    assert set(saved) == MEGATRON_LM_FILE_KEYS | {"recover_state"}
    assert saved["iteration"] == 2 and saved["checkpoint_version"] == 3.0
    assert len(saved["rng_state"]) == 1 and set(saved["rng_state"][0]) == MEGATRON_LM_RNG_NAMES
    params = torch.load(tmp_path / "full" / "status" / "rank-0.params.pt")
    assert {k for k in saved["model"] if not k.endswith("_extra_state")} == set(params)

    # A file as Megatron-LM writes it: no recovery state, and its whole argument namespace (here
    # every argument our parser has, its defaults under the run's values).
    megatron = tmp_path / "megatron-lm"
    (megatron / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    args = vars(build_parser().parse_args([]))
    args.update(vars(saved["args"]))
    torch.save({**{k: v for k, v in saved.items() if k != "recover_state"},
                "args": argparse.Namespace(**args)},
               megatron / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    (megatron / "latest_checkpointed_iteration.txt").write_text("2\n")
    result, resumed = train(tmp_path / "from-megatron-lm", 2, [*four, "--load", str(megatron)])
    assert "resumed iteration 2" in result.output and sorted(resumed) == [3, 4]
    assert [resumed[t]["loss"] for t in (3, 4)] == [full[t]["loss"] for t in (3, 4)]
    assert params_rdiff(tmp_path / "from-megatron-lm", tmp_path / "full", [0, 1]) == 0
    result, no_optim = train(tmp_path / "no-optim", 2, [*four, "--load", str(ckpt),
                                                       "--ckpt-step", "2", "--no-load-optim"])
    assert "resumed iteration 2" in result.output and sorted(no_optim) == [3, 4]
    assert no_optim[3]["loss"] == full[3]["loss"]
    assert params_rdiff(tmp_path / "no-optim", tmp_path / "full", [0, 1]) > 0
    result, tuned = train(tmp_path / "finetune", 2, ["--train-iters", "2", "--load", str(ckpt),
                                                     "--finetune"])
    assert "fine-tuning from" in result.output and sorted(tuned) == [1, 2]
    assert tuned[1]["loss"] != full[1]["loss"]  # the same data, the trained model


@pytest.mark.long  # make test: a torn torch_dist file in test_dist_checkpoint.py
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_a_checkpoint_that_does_not_fit_stops_at_start_up(tmp_path):
    """Another model shape, another vocabulary, a torn file: each relaunch stops before training
    with what is wrong, and the checkpoint directory is left as it was (--ckpt-format torch,
    whose files are this project's; test_dist_checkpoint.py loads a torch_dist checkpoint into
    another model shape)."""
    ckpt = tmp_path / "ckpt"
    torch_format = ["--ckpt-format", "torch"]
    train(tmp_path / "saved", 2, [*torch_format, "--train-iters", "2", "--save-interval", "2",
                                  "--save", str(ckpt)])
    torn = tmp_path / "torn"
    shutil.copytree(ckpt, torn)
    (victim,) = (torn / "iter_0000002").glob("*/model_optim_rng.pt")
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    before = {p: p.read_bytes() for d in (ckpt, torn) for p in d.rglob("*") if p.is_file()}

    def stopped(name, load, extra=()):
        result = launch(LaunchConfig(2, [*ENTRY, *JOB, *torch_format, "--train-iters", "2",
                                         "--load", str(load), "--save", str(load),
                                         "--save-interval", "2", *extra],
                                     tmp_path / name / "status", TIMEOUT_S))
        assert not result.timed_out, result.output[-3000:]
        assert {s.get("state") for s in result.statuses.values()} == {"error"}, result.statuses
        assert "iteration        1/" not in result.output  # nothing trained
        return result.output

    output = stopped("hidden", ckpt, ["--hidden-size", "64"])
    assert "megatron-recover: error: --load: the model in" in output
    assert "size mismatch for" in output and "--hidden-size" in output
    output = stopped("vocab", ckpt, ["--vocab-size", "300"])  # padded: 384 rows, not 256
    assert "size mismatch for embedding.word_embeddings.weight" in output
    output = stopped("torn-run", torn)
    assert f"--load: {victim} cannot be read" in output and "torn or partial" in output
    after = {p: p.read_bytes() for d in (ckpt, torn) for p in d.rglob("*") if p.is_file()}
    assert after == before
    # TP=2: each rank reads its own position's file; only rank 1's is torn. Rank 0 loads its
    # own fine, and still stops with rank 1's reason rather than train on alone.
    tp = tmp_path / "tp"
    train(tmp_path / "tp-saved", 2, [*torch_format, "--tensor-model-parallel-size", "2",
                                     "--train-iters", "2", "--save-interval", "2",
                                     "--save", str(tp)])
    victim = tp / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    output = stopped("tp-run", tp, ["--tensor-model-parallel-size", "2"])
    assert f"--load: {victim} cannot be read" in output


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_bf16_fine_tune_trains_the_loaded_model(tmp_path):
    """bf16 keeps fp32 main parameters in the optimizer: a load that leaves the optimizer out
    (--finetune) must refill them from the loaded model, or the first step writes the initial
    weights back. With --lr 0 a step changes nothing, so the fine-tune's final parameters are
    the checkpoint's, bitwise."""
    ckpt = tmp_path / "ckpt"
    saved, _ = train(tmp_path / "saved", 2, ["--bf16", "--train-iters", "2", "--save-interval",
                                             "2", "--save", str(ckpt)])
    tuned, records = train(tmp_path / "tuned", 2, ["--bf16", "--train-iters", "1", "--load",
                                                   str(ckpt), "--finetune", "--lr", "0.0"])
    assert sorted(records) == [1] and "fine-tuning from" in tuned.output
    digests = {s["param_digest"] for s in saved.statuses.values()}
    assert len(digests) == 1 and {s["param_digest"] for s in tuned.statuses.values()} == digests
