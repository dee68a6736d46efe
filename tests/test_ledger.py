"""The gradient ledger (layer 2) and the invariant's audit, without processes.

Run: `.venv/bin/python -m pytest tests/test_ledger.py` (CPU, a second). The end-to-end checks are
in tests/test_ledger_recovery.py and tests/test_ledger_mutations.py.
"""

import torch

from megatron_recover.megatron.data.audit import DatasetAudit
from megatron_recover.megatron.data.datasets import batch_checksum
from megatron_recover.recovery import Entry, LaneLayout, Ledger

B = 4


def ledger(*ids, iteration=1):
    out = Ledger()
    for k in ids:
        out.register(Entry(iteration, k, 100 + k))
    return out


def test_lane_sums_are_the_union_of_ledgers():
    layout = LaneLayout(B, reserve=False)
    lane = layout.encode(ledger(0, 1), 1) + layout.encode(ledger(2, 3), 1)
    totals = layout.decode(lane)
    assert totals.main_counts == (1, 1, 1, 1) and totals.count == 4
    assert totals.checksum == sum(100 + k for k in range(4))
    assert not totals.poison and not totals.foreign


def test_twice_foreign_and_unknown_are_visible():
    layout = LaneLayout(B, reserve=False)
    assert layout.decode(layout.encode(ledger(1, 1), 1)).main_counts == (0, 2, 0, 0)
    assert layout.decode(layout.encode(ledger(1, iteration=2), 1)).foreign == 1
    assert layout.decode(layout.encode(Ledger(known=False), 1)).poison == 1
    assert layout.decode(layout.encode(ledger(1), 1, poison=1)).poison == 1


def test_reserve_ids_are_named_exactly():
    layout = LaneLayout(B, reserve=True)
    ids = (B + 1, B + 2 * B + 3, B + 5 * 2 * B)
    totals = layout.decode(layout.encode(ledger(0, *ids), 1))
    assert totals.reserve == tuple(sorted(ids)) and totals.main_counts == (1, 0, 0, 0)
    clash = layout.decode(layout.encode(ledger(B, B + 2 * B), 1))
    assert clash.reserve == () and clash.reserve_clash == 2


def test_snapshot_rewind_zero_and_add_back_follow_the_gradient():
    a = ledger(0, 1)
    snapshot = a.copy()
    a.clear()
    a.register(Entry(1, 2, 102))
    a.add(snapshot)
    assert a == ledger(0, 1, 2)
    a.add(snapshot)
    assert a != ledger(0, 1, 2)  # added twice: ids 0 and 1 counted twice


class Samples:
    """A dataset stand-in: sample i is tokens i..i+7."""

    def __getitem__(self, i):
        tokens = torch.arange(i, i + 8)
        return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(8)}


def exact_lane(audit, layout, iteration, ids):
    out = Ledger()
    for k in ids:
        out.register(Entry(iteration, k, audit.checksum(iteration, k)))
    return layout.decode(layout.encode(out, iteration))


def test_audit_exact_mode():
    audit = DatasetAudit(Samples(), global_batch_size=2 * B, micro_batch_size=2,
                        main_samples=3 * 2 * B, policy="static", mode="exact")
    layout = LaneLayout(B, reserve=False)
    assert audit.problems(2, exact_lane(audit, layout, 2, range(B)), B) == []
    assert "ids missing: [3]" in audit.problems(2, exact_lane(audit, layout, 2, range(3)), B)
    doubled = audit.problems(2, exact_lane(audit, layout, 2, [0, 1, 2, 3, 3]), B)
    assert any("more than once" in p for p in doubled)
    # Iteration 2, id 1 is samples 10, 11 (GBS 8, mbs 2), independently of MicrobatchSource.
    rows = [Samples()[i] for i in (10, 11)]
    assert audit.checksum(2, 1) == batch_checksum(*(torch.stack([r[k] for r in rows])
                                                    for k in ("tokens", "labels", "loss_mask")))
    wrong = Ledger()
    for k in range(B):
        wrong.register(Entry(2, k, audit.checksum(2, k) if k else audit.checksum(2, 1)))
    problems = audit.problems(2, layout.decode(layout.encode(wrong, 2)), B)
    assert len(problems) == 1 and "checksums" in problems[0]


def test_audit_reserve_ids_once_per_run():
    audit = DatasetAudit(Samples(), global_batch_size=B, micro_batch_size=1, main_samples=3 * B,
                        policy="static", mode="reserve")
    layout = LaneLayout(B, reserve=True)
    first = exact_lane(audit, layout, 1, [0, 1, 2, B])
    assert audit.problems(1, first, B) == []
    audit.committed(first)
    again = exact_lane(audit, layout, 2, [0, 1, 2, B])
    assert any("earlier iteration" in p for p in audit.problems(2, again, B))
    assert audit.problems(2, exact_lane(audit, layout, 2, [0, 1, 2, B + 1]), B) == []


def test_audit_adaptive_counts_what_it_divides_by():
    audit = DatasetAudit(Samples(), global_batch_size=B, micro_batch_size=1, main_samples=3 * B,
                        policy="adaptive", mode="exact")
    layout = LaneLayout(B, reserve=False)
    lane = exact_lane(audit, layout, 1, [0, 2])
    assert audit.problems(1, lane, 2) == []
    assert audit.problems(1, lane, 3) == ["2 microbatch gradients, divided by 3"]
