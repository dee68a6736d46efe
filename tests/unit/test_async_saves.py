"""--async-save's caller (`dist_checkpoint.AsyncSaves`) with a stand-in for megatron's writer:
what the forked writer writes is the state at the save, whatever training changes after it; the
checkpoint is completed once, only after the writer ended; an abandoned save is never
completed; a writer that fails is reported.

Run: .venv/bin/python -m pytest tests/unit/test_async_saves.py   (no MPI; seconds)
"""

import os
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_recover.megatron.persistence import torch_dist as dist_checkpoint

pytestmark = pytest.mark.unit


def _writer(rank, buckets, results, delay_s=0.0, fail=False):
    """Megatron's writer's signature: (rank, write buckets, results queue); it writes each
    bucket's tensors to its file and puts one result dict."""
    time.sleep(delay_s)
    if fail:
        os._exit(3)
    for path, key, (_, tensors) in buckets:
        torch.save([tensor for _, tensor in tensors], path)
    results.put({rank: [key for _, key, _ in buckets]})


def _save(tmp_path, tensor, **writer_kwargs):
    results = dist_checkpoint._fresh_results_queue(forked=True)
    request = SimpleNamespace(
        async_fn=_writer, async_fn_kwargs=writer_kwargs, finalize_fns=[],
        async_fn_args=[0, [(str(tmp_path / "w.pt"), "w", ([], [("item", tensor)]))], results])
    completed = []

    def complete(req):  # megatron's finalization takes the writer's results first
        completed.append((req, results.get_nowait(), (tmp_path / "w.pt").is_file()))

    saves = dist_checkpoint.AsyncSaves()
    saves.start(request, results, complete, agree=None)
    return saves, request, completed


def test_the_writer_writes_the_state_at_the_save_and_completes_once_after_it_ended(tmp_path):
    weights = torch.arange(4.0)
    saves, request, completed = _save(tmp_path, weights, delay_s=0.3)
    weights.add_(100.0)  # the next optimizer step, while the writer still sleeps
    saves.poll()
    assert completed == []  # still writing: the tracker stays where it was
    deadline = time.monotonic() + 30
    while not completed and time.monotonic() < deadline:
        time.sleep(0.05)
        saves.poll()
    assert completed == [(request, {0: ["w"]}, True)]
    assert torch.equal(torch.load(tmp_path / "w.pt")[0], torch.arange(4.0))
    saves.poll(blocking=True)  # nothing in flight any more
    assert len(completed) == 1


def test_a_blocking_poll_waits_for_the_writer(tmp_path):
    saves, request, completed = _save(tmp_path, torch.ones(3), delay_s=0.3)
    saves.poll(blocking=True)
    assert completed == [(request, {0: ["w"]}, True)]


def test_an_abandoned_save_is_never_completed(tmp_path):
    saves, _, completed = _save(tmp_path, torch.ones(3), delay_s=0.2)
    saves.abandon()
    assert (tmp_path / "w.pt").is_file()  # the writer ended first
    saves.poll(blocking=True)
    assert completed == []


def test_a_writer_that_fails_is_reported_and_the_save_not_completed(tmp_path):
    saves, _, completed = _save(tmp_path, torch.ones(3), fail=True)
    with pytest.raises(RuntimeError, match="writer process ended with exit code 3"):
        saves.poll(blocking=True)
    assert completed == []
