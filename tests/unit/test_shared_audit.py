"""The ledger audit's expected side in shares (megatron_recover/megatron/data/audit.py): contributors
to a lane each read a disjoint share of the iteration's samples; the summed shares give the
same verdicts as one rank reading them all, and a share that is missing or wrong is reported.

Run: .venv/bin/python -m pytest tests/unit/test_shared_audit.py (CPU only, seconds).
"""

import pytest

from megatron_recover.megatron.app import run
from megatron_recover.megatron.config.arguments import parse_args
from megatron_recover.megatron.data.audit import DatasetAudit
from megatron_recover.recovery.ledger import LaneTotals

pytestmark = pytest.mark.unit
B = 8


@pytest.fixture(scope="module")
def audit():
    cfg = parse_args(("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                      f"--max-position-embeddings 16 --micro-batch-size 1 --global-batch-size {B} "
                      "--train-iters 3 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
                      "--vocab-size 64").split(), world_size=1, cuda_available=False)
    source, _ = run.microbatch_source(cfg)
    return DatasetAudit(source.dataset, global_batch_size=B, micro_batch_size=1,
                       main_samples=cfg.train_samples, policy="static", mode="exact")


def committed(audit, iteration: int, ids=range(B)) -> LaneTotals:
    """The totals of a lane that committed `ids` with the dataset's own checksums."""
    counts = [1 if k in ids else 0 for k in range(B)]
    return LaneTotals(main_counts=tuple(counts), reserve=(), reserve_clash=0,
                      checksum=sum(audit.checksum(iteration, k) for k in ids), foreign=0,
                      poison=0)


@pytest.mark.parametrize("count", [1, 3, 8, 11])
def test_shares_cover_each_id_once_and_agree_with_reading_all(audit, count):
    shares = [audit.share(2, index, count) for index in range(count)]
    ids = sorted(k for share in shares for k in share)
    assert ids == list(range(B))  # disjoint, complete
    expected = {k: v for share in shares for k, v in share.items()}
    assert expected == {k: (audit.checksum(2, k), audit.tokens(2, k)) for k in range(B)}
    totals = committed(audit, 2)
    tokens = sum(audit.tokens(2, k) for k in range(B))
    assert audit.problems(2, totals, B, tokens, expected) == []
    assert audit.problems(2, totals, B, tokens) == []  # read here, the same verdict


def test_a_missing_or_wrong_share_is_reported(audit):
    expected = {k: v for index in range(3) for k, v in audit.share(1, index, 3).items()}
    totals = committed(audit, 1)
    missing = {k: v for k, v in expected.items() if k % 3 != 2}
    found = audit.problems(1, totals, B, None, missing)
    assert any("was not computed exactly once" in p for p in found), found
    wrong = dict(expected)
    wrong[4] = (wrong[4][0] + 1, wrong[4][1])
    found = audit.problems(1, totals, B, None, wrong)
    assert any("batch checksums" in p for p in found), found
    # What the shares check is still the dataset: a lane whose batches differ is caught.
    forged = committed(audit, 1)
    forged = LaneTotals(forged.main_counts, (), 0, forged.checksum + 1, 0, 0)
    assert any("batch checksums" in p for p in audit.problems(1, forged, B, None, expected))
