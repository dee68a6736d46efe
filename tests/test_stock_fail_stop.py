"""A stock Megatron job over the ulfm backend stops at a death, as one over gloo does.

`scripts/run_restart_baseline.py --cross-replica-backend ulfm` (the benchmark's baseline): one
rank is SIGKILLed as iteration 4 begins; the survivors' data-parallel all-reduce must raise
(torch.distributed on a ulfm group fails stop), so the job goes down by itself, without the
driver forcing it, and the relaunch resumes from the checkpoint and completes.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import run_restart_baseline as baseline  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.e2e]

JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--eval-iters", "0", "--seq-length", "32", "--max-position-embeddings", "32",
       "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3", "--mock-data",
       "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--overlap-grad-reduce",
       "--log-interval", "1"]


@pytest.mark.long
@pytest.mark.timeout(400)
def test_stock_job_over_ulfm_fails_stop_and_restarts(tmp_path):
    cfg = baseline.BaselineConfig(ranks=4, job=JOB, train_iters=6, save_interval=2,
                                  failures=[4], out=tmp_path, attempt_timeout_s=180.0,
                                  handling_timeout_s=30.0, cross_replica_backend="ulfm")
    result = baseline.run_baseline(cfg, progress=print)
    first, second = result["attempts"]
    assert first["kill"]["rank"] == 3 and first["kill"]["iteration"] == 4
    # Down by itself: every survivor raised at the death, in whichever collective saw it
    # first (ulfm's fail-stop error, or gloo's lost connection on the world group); no forced
    # teardown, no timeout.
    assert not first["down_forced"], first
    statuses = baseline.read_statuses(tmp_path / "status-0")
    survivors = {rank: s for rank, s in statuses.items() if rank != 3}
    assert sorted(survivors) == [0, 1, 2]
    assert all(s["state"] in ("error", "left") for s in survivors.values()), survivors
    stopped_by_ulfm = [r for r, s in survivors.items()
                       if "DistBackendError" in s["error"] and "a peer died" in s["error"]]
    assert stopped_by_ulfm, survivors
    assert all(r in stopped_by_ulfm or "Connection closed by peer" in s["error"]
               for r, s in survivors.items()), survivors
    assert first["down"] - first["kill"]["time"] < cfg.handling_timeout_s
    assert second["load"]["iteration"] == 2 and second["completed"]
    assert [r["iteration"] for r in second["iterations"]] == [3, 4, 5, 6]
