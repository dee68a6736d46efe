"""CPU emulation of CUDA for unmodified megatron-core (megatron_recover/testing/cpu_emulation.py).

Run:  python -m pytest tests/test_cpu_emulation.py -q -p no:cacheprovider
      (with the project's interpreter: megatron-core 0.16.1, torch, pytest-timeout installed)

Hardware: CPU only, no GPU needed. On a machine with CUDA the emulation refuses to start, so
everything but the refusal test is skipped there. The training tests start 1-2 gloo ranks per
layout as subprocesses (rendezvous through a TCP store this process hosts on 127.0.0.1); each run
has a hard deadline after which its process groups are killed. The whole file takes ~1 minute.

The training tests train the same 2-layer GPT on the same data in four layouts (DP=1 reference,
DP=2, TP=2, PP=2) for 3 iterations and check: losses finite; data-parallel replicas bitwise equal
after every step; every layout's losses and gradient norms equal the reference's within 1e-5.
"""

import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_recover.testing import (
    cpu_emulation_enabled,
    disable_cpu_emulation,
    enable_cpu_emulation,
    is_enabled,
    on_device,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_emulation_worker.py")
ITERATIONS = 3
RUN_DEADLINE_S = 100
LOSS_TOLERANCE = 1e-5

needs_no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU emulation refuses to run where CUDA is available"
)

# The namespaces emulation patches; disabling must leave each exactly as it was.
_PATCHED_NAMESPACES = (
    torch, torch.Tensor, torch.cuda, torch.cuda.random, torch.cuda.memory, torch.cuda.nvtx,
)


@pytest.fixture
def emulation():
    with cpu_emulation_enabled():
        yield


def test_refuses_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        enable_cpu_emulation()
    assert not is_enabled()


@needs_no_cuda
def test_enable_and_disable_are_explicit():
    assert not is_enabled()
    with pytest.raises(RuntimeError, match="not enabled"):
        disable_cpu_emulation()
    with cpu_emulation_enabled():
        assert is_enabled()
        with pytest.raises(RuntimeError, match="already enabled"):
            enable_cpu_emulation()
    assert not is_enabled()


@needs_no_cuda
def test_disable_restores_every_patched_attribute():
    before = [dict(vars(namespace)) for namespace in _PATCHED_NAMESPACES]
    with cpu_emulation_enabled():
        assert torch.empty(1, device="cuda").device.type == "cpu"
    for namespace, saved in zip(_PATCHED_NAMESPACES, before):
        now = vars(namespace)
        changed = [name for name, value in saved.items() if now.get(name, None) is not value]
        assert not changed, f"{namespace.__name__}: not restored: {changed}"
    assert set(vars(torch.Tensor)) == set(before[1]), "Tensor kept an emulation attribute"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.empty(1, device="cuda")


@needs_no_cuda
@pytest.mark.parametrize(
    "device", ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0]
)
def test_cuda_tensors_are_created_on_the_host(emulation, device):
    created = [
        torch.empty(2, device=device),
        torch.zeros(2, device=device),
        torch.full((2,), 3.0, device=device),
        torch.tensor([1, 2], device=device),
        torch.arange(4, device=device),
        torch.randn(2, device=device),
        torch.empty_like(torch.ones(2), device=device),
        torch.ones(2).new_zeros(3, device=device),
        torch.ones(2).to(device),
        torch.ones(2).to(device, torch.float64),
        torch.ones(2).to(device=device),
    ]
    assert all(tensor.device.type == "cpu" for tensor in created)
    assert created[9].dtype == torch.float64


@needs_no_cuda
def test_moves_to_the_device_stay_on_the_host(emulation):
    host = torch.ones(3)
    moved = host.cuda()
    assert moved.device.type == "cpu" and torch.equal(moved, host)
    # As on a GPU: a host tensor's move is a copy on the device, the host tensor stays behind.
    assert moved is not host and moved.data_ptr() != host.data_ptr()
    assert on_device(moved) and not on_device(host)
    assert moved.cuda() is moved and moved.to("cuda") is moved, "already on the device"
    assert on_device(host.to("cuda")) and on_device(host.to(moved))
    assert on_device(moved[1:]) and on_device(moved.detach()), "views share the placement"
    assert on_device(moved.clone()) and on_device(torch.empty_like(moved))
    assert not on_device(host.clone()) and not on_device(torch.empty_like(host))
    assert on_device(torch.zeros(2, device="cuda")) and on_device(moved.new_zeros(2))
    assert on_device(moved.to(torch.float64)) and not on_device(host.to(torch.float64))
    linear = torch.nn.Linear(2, 2)
    assert not any(on_device(p) for p in linear.parameters())
    linear.cuda()
    assert linear.weight.device.type == "cpu"
    assert all(on_device(p) for p in linear.parameters())
    assert isinstance(linear.weight, torch.nn.Parameter)
    assert host.type() == "torch.cuda.FloatTensor"
    assert host.type(torch.float64).dtype == torch.float64


@needs_no_cuda
def test_a_freed_device_storage_leaves_no_mark(emulation):
    """A host tensor allocated where a freed device tensor was is not taken for one."""
    for _ in range(2000):
        assert not on_device(torch.ones(16))
        torch.ones(16).cuda()


@needs_no_cuda
def test_device_ordinals_are_checked():
    with cpu_emulation_enabled(device_count=2):
        torch.cuda.set_device(1)
        assert torch.cuda.current_device() == 1
        assert torch.empty(1, device="cuda:1").device.type == "cpu"
        with pytest.raises(RuntimeError, match="invalid device ordinal 2"):
            torch.empty(1, device="cuda:2")
        with pytest.raises(RuntimeError, match="invalid device ordinal 2"):
            torch.cuda.set_device(2)
        assert torch.cuda.device_count() == 2


@needs_no_cuda
def test_unemulated_cuda_calls_fail_by_name(emulation):
    with pytest.raises(RuntimeError, match="get_device_properties is not covered"):
        torch.cuda.get_device_properties(0)


@needs_no_cuda
def test_streams_events_and_nvtx(emulation):
    side = torch.cuda.Stream(device=torch.cuda.current_device())
    assert torch.cuda.current_stream() is torch.cuda.default_stream()
    context = torch.cuda.stream(side)
    for _ in range(2):  # reusable, as torch's StreamContext is (megatron-core enters one twice)
        with context:
            assert torch.cuda.current_stream() is side
            side.wait_stream(torch.cuda.default_stream())
        assert torch.cuda.current_stream() is torch.cuda.default_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    torch.cuda.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.cuda.Event().elapsed_time(end)
    with torch.cuda.nvtx.range("emulated"):
        torch.cuda.nvtx.mark("inside")
    assert torch.cuda.memory_allocated() == torch.cuda.max_memory_reserved() == 0
    torch.cuda.empty_cache()


@needs_no_cuda
def test_megatron_rng_tracker_forks_the_stream_dropout_draws_from(emulation):
    """megatron's tracker sets RNG states through torch.cuda._lazy_call; they must take effect."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    def dropout_mask():
        return F.dropout(torch.ones(64), p=0.5, training=True) != 0

    torch.cuda.manual_seed(11)
    outside = torch.cuda.get_rng_state()
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    with tracker.fork("model-parallel-rng"):
        first = dropout_mask()
    assert torch.equal(torch.get_rng_state(), outside), "fork did not restore the outer state"
    with tracker.fork("model-parallel-rng"):
        second = dropout_mask()
    torch.manual_seed(7)
    assert torch.equal(first, dropout_mask()), "fork did not switch to the tracked seed"
    assert torch.equal(second, dropout_mask()), "the tracked state did not advance"


# --- multi-process training runs ---------------------------------------------------------------


def _run_layout(out_dir: Path, world_size: int, tp: int = 1, pp: int = 1) -> dict:
    """Run one layout's ranks to completion; return {"records": [...], "init": [...]} by rank.

    Each rank runs in its own session, so that whatever ends this call (success, a failure, the
    deadline, pytest's timeout) kills exactly the processes it started, by process group.
    """
    out_dir.mkdir()
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=RUN_DEADLINE_S),
    )
    python_path = [str(REPO_ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, python_path))
    )
    processes = []
    try:
        for rank in range(world_size):
            command = [
                sys.executable, str(WORKER), "--rank", str(rank), "--world-size", str(world_size),
                "--store-port", str(store.port), "--tp", str(tp), "--pp", str(pp),
                "--iterations", str(ITERATIONS), "--out", str(out_dir),
            ]
            with open(out_dir / f"log{rank}.txt", "w") as log:
                processes.append(subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                ))
        timed_out = _wait_until_deadline(processes)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    _fail_unless_all_succeeded(processes, timed_out, out_dir)
    return {
        "records": [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)],
        # Written by our own worker; the pieces hold slice objects, which weights_only refuses.
        "init": [
            torch.load(out_dir / f"init{r}.pt", weights_only=False) for r in range(world_size)
        ],
    }


def _wait_until_deadline(processes) -> bool:
    """Wait for every process, at most RUN_DEADLINE_S in all; True when the deadline hit."""
    deadline_s = time.monotonic() + RUN_DEADLINE_S
    try:
        for process in processes:
            process.wait(timeout=max(0.0, deadline_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        return True
    return False


def _fail_unless_all_succeeded(processes, timed_out: bool, out_dir: Path) -> None:
    failed = [(rank, process.returncode) for rank, process in enumerate(processes)
              if process.returncode != 0]
    if timed_out or failed:
        logs = "\n".join(f"--- rank {rank} ---\n{(out_dir / f'log{rank}.txt').read_text()[-3000:]}"
                         for rank in range(len(processes)))
        pytest.fail(f"run failed (deadline hit: {timed_out}, exit codes: {failed})\n{logs}")


def _assemble(init_pieces_by_rank) -> dict:
    """Global tensors from every rank's main-replica pieces; every element must be covered."""
    assembled = {}
    for pieces in init_pieces_by_rank:
        for key, global_shape, index, values in pieces:
            full = assembled.setdefault(key, torch.full(global_shape, float("nan")))
            full[index] = values
    uncovered = [key for key, full in assembled.items() if torch.isnan(full).any()]
    assert not uncovered, f"no rank holds the main copy of part of {uncovered}"
    return assembled


def _last_stage_losses(run) -> list:
    losses = [record["losses"] for record in run["records"] if record["losses"][0] is not None]
    assert losses, "no rank reported a loss"
    return losses[0]


def _compare_with_reference(run, reference, label: str) -> None:
    losses, expected = _last_stage_losses(run), _last_stage_losses(reference)
    assert all(math.isfinite(loss) for loss in losses), losses
    loss_diff = max(abs(a - b) for a, b in zip(losses, expected))
    norm_diff = max(abs(a - b) for record in run["records"]
                    for a, b in zip(record["grad_norms"], reference["records"][0]["grad_norms"]))
    print(f"\n{label} vs DP=1: losses {losses}, max |loss diff| {loss_diff:.3e}, "
          f"max |grad norm diff| {norm_diff:.3e}")
    assert loss_diff <= LOSS_TOLERANCE
    assert norm_diff <= LOSS_TOLERANCE


def _assert_trained(record) -> None:
    digests = record["param_digests"]
    assert len(digests) == ITERATIONS + 1
    assert len(set(digests)) == len(digests), (
        f"rank {record['rank']}: a step left its parameters unchanged"
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """DP=1, one process: both microbatches of each global batch on one rank."""
    return _run_layout(tmp_path_factory.mktemp("emulation") / "dp1", world_size=1)


@needs_no_cuda
@pytest.mark.timeout(300)
def test_dp2_replicas_stay_bitwise_equal(reference, tmp_path):
    run = _run_layout(tmp_path / "dp2", world_size=2)
    first, second = run["records"]
    assert first["dp_rank"] != second["dp_rank"]
    _assert_trained(first)
    assert first["param_digests"] == second["param_digests"], "DP replicas diverged"
    assert first["losses"] == second["losses"]
    _compare_with_reference(run, reference, "DP=2")


@needs_no_cuda
@pytest.mark.timeout(300)
def test_tp2_matches_single_process(reference, tmp_path):
    run = _run_layout(tmp_path / "tp2", world_size=2, tp=2)
    assert sorted(record["tp_rank"] for record in run["records"]) == [0, 1]
    for record in run["records"]:
        _assert_trained(record)
    _compare_with_reference(run, reference, "TP=2")
    # megatron's own use_cpu_initialization draws each full weight on every TP rank and keeps its
    # shard, so (unlike pipeline stages) TP shards assemble to exactly the single-process init.
    sharded, full = _assemble(run["init"]), _assemble(reference["init"])
    assert sharded.keys() == full.keys()
    assert all(torch.equal(sharded[key], full[key]) for key in full)


@needs_no_cuda
@pytest.mark.timeout(300)
def test_pp2_matches_single_process(reference, tmp_path):
    run = _run_layout(tmp_path / "pp2", world_size=2, pp=2)
    assert sorted(record["pp_rank"] for record in run["records"]) == [0, 1]
    for record in run["records"]:
        _assert_trained(record)
    assert [record["losses"][0] is None for record in run["records"]] == [True, False]
    _compare_with_reference(run, reference, "PP=2")
