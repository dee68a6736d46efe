"""The commit-lane and replica-verdict codecs (`megatron_recover.recovery.lane`).

Run: .venv/bin/python -m pytest tests/unit/test_codecs.py   (no MPI; seconds)

The lane of several replicas is summed (one all-reduce) and must decode to the union of their
ledgers and the sums of their heads; the verdict of several positions is combined by an
element-wise MAX and must decode to the union of the dead replicas and the OR of the flags, with
the loss of the one position that holds it.
"""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_recover.recovery import CommitLane, Entry, LaneHead, LaneLayout, Ledger
from megatron_recover.recovery.checks.ledger_audit import ExpectedSlots
from megatron_recover.recovery.checks.stragglers import SpeedSlots, Stragglers
from megatron_recover.recovery.lane import VerdictCodec

pytestmark = pytest.mark.unit

B = 6


@st.composite
def sent_ledgers(draw, iteration):
    ids = draw(st.lists(st.integers(0, B - 1), max_size=B))
    entries = Counter(Entry(iteration, k, 1000 + k) for k in ids)
    return Ledger(entries)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(sent_ledgers(3), st.integers(0, 64), st.integers(0, 50),
                          st.booleans()), min_size=1, max_size=5))
def test_summed_lanes_decode_to_the_union_of_ledgers(replicas):
    codec = CommitLane(LaneLayout(B, reserve=False))
    lanes = [codec.encode(LaneHead(loss / 8, tokens, stop), ledger, iteration=3)
             for ledger, loss, tokens, stop in replicas]
    summed = torch.stack(lanes).sum(dim=0)
    head, totals = codec.decode_head(summed), codec.decode_ledger(summed)
    union = Counter()
    for ledger, *_ in replicas:
        union.update(ledger.entries)
    assert totals.main_counts == tuple(union[Entry(3, k, 1000 + k)] for k in range(B))
    assert totals.checksum == sum(n * e.checksum for e, n in union.items())
    assert totals.foreign == totals.poison == 0
    assert head.loss_sum == sum(loss / 8 for _, loss, _, _ in replicas)
    assert head.tokens == sum(tokens for _, _, tokens, _ in replicas)
    assert head.exit_requested == any(stop for *_, stop in replicas)


def test_a_lane_of_nothing_sent_and_an_unknown_ledger():
    codec = CommitLane(LaneLayout(B, reserve=False))
    assert codec.decode_ledger(codec.empty()).count == 0
    assert codec.decode_ledger(codec.encode(LaneHead(0.0, 0, False), Ledger(known=False),
                                            iteration=1)).poison == 1
    foreign = Ledger(Counter({Entry(2, 0, 5): 1}))
    assert codec.decode_ledger(codec.encode(LaneHead(0.0, 0, False), foreign, 1)).foreign == 1


@settings(max_examples=200, deadline=None)
@given(w_init=st.integers(1, 8), data=st.data())
def test_positions_combined_by_max_decode_to_the_replica_verdict(w_init, data):
    codec = VerdictCodec(w_init, [("flag", 1)])
    positions = data.draw(st.integers(1, 4))
    last = data.draw(st.integers(0, positions - 1))  # the position that sees the losses
    loss, tokens = data.draw(st.integers(0, 1000)) / 4, data.draw(st.integers(0, 500))
    views = [(set(data.draw(st.lists(st.integers(0, w_init - 1), max_size=w_init))),
              data.draw(st.booleans()), data.draw(st.booleans()), data.draw(st.booleans()))
             for _ in range(positions)]
    vectors = [codec.encode(dead, failed,
                            LaneHead(loss if p == last else 0.0, tokens if p == last else 0,
                                     stop), {"flag": torch.tensor([float(bad)])})
               for p, (dead, failed, bad, stop) in enumerate(views)]
    verdict = codec.decode(torch.stack(vectors).max(dim=0).values)
    assert verdict.dead == frozenset().union(*(dead for dead, *_ in views))
    assert verdict.commit == (not any(failed for _, failed, _, _ in views))
    assert bool(verdict.parts["flag"][0]) == any(bad for _, _, bad, _ in views)
    assert verdict.exit_requested == any(stop for *_, stop in views)
    assert (verdict.loss_sum, verdict.tokens) == (loss, tokens)


def test_a_replica_id_outside_the_launch_is_refused():
    with pytest.raises(ValueError, match="outside"):
        VerdictCodec(2).encode({2}, False, LaneHead(0.0, 0, False))


def test_segments_follow_the_registered_sizes_and_a_wrong_size_is_refused():
    """The layouts come from the registered checks: each segment where the sizes put it, zeros
    for a check that sends none, and a segment of the wrong size refused."""
    lane = CommitLane(LaneLayout(B, reserve=False), [("a", 2), ("b", 3)])
    assert lane.size == CommitLane.HEAD + LaneLayout(B, reserve=False).size + 5
    vector = lane.encode(LaneHead(0.0, 0, False), None, 3, parts={"b": torch.tensor([1., 2, 3])})
    parts = lane.decode_parts(vector)
    assert parts["a"].tolist() == [0.0, 0.0] and parts["b"].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="segment 'a' holds 2"):
        lane.encode(LaneHead(0.0, 0, False), None, 3, parts={"a": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"no segment named \['c'\]"):
        lane.encode(LaneHead(0.0, 0, False), None, 3, parts={"c": torch.zeros(1), "a": None})
    assert torch.equal(lane.encode(LaneHead(0.0, 0, False), None, 3, parts={"c": None}),
                       lane.encode(LaneHead(0.0, 0, False), None, 3))
    with pytest.raises(ValueError, match="two segments"):
        VerdictCodec(2, [("a", 1), ("a", 1)])


def test_replica_times_sum_exactly_and_take_each_replicas_slowest_position():
    """The lane carries each replica's time per microbatch as whole microseconds, with the
    number of its shards that measured: summed over replicas and shards, it decodes to the
    mean over the measuring shards; the verdict keeps a replica's slowest position."""
    slots = SpeedSlots(3)
    parts = [slots.encode(0, 0.0123456),  # replica 0, one shard
             slots.encode(2, 0.020),  # replica 2, two shards
             slots.encode(2, 0.030),
             slots.encode(1, None)]  # replica 1 ran no microbatch
    summed = sum(parts[1:], parts[0].clone())
    assert slots.decode(summed) == {0: 0.012346, 2: 0.025}
    check = Stragglers(3, straggler=None)
    views = [check.view(None, 3, slots.encode(0, 0.01) + slots.encode(2, 0.05), None, None),
             check.view(None, 3, slots.encode(0, 0.03) + slots.encode(2, 0.02), None, None)]
    assert check.speeds(torch.maximum(*views)) == {0: 0.03, 2: 0.05}
    assert check.speeds(torch.zeros(3, dtype=torch.float64)) == {}


def test_the_audits_shares_sum_to_every_id_once():
    """Each contributor fills its share of the expected side; summed, each id decodes from the
    one rank that computed it, and an id computed twice or never is left out."""
    slots = ExpectedSlots(B)
    values = {k: (1000 + 7 * k, 50 + k) for k in range(B)}
    parts = [slots.encode({k: values[k] for k in range(i, B, 3)}) for i in range(3)]
    assert slots.decode(torch.stack(parts).sum(dim=0)) == values
    # A rank that computed every id (a wrong share) and one that computed none.
    doubled = [*parts, slots.encode({0: values[0]})]
    decoded = slots.decode(torch.stack(doubled).sum(dim=0))
    assert 0 not in decoded and decoded == {k: v for k, v in values.items() if k}
    assert slots.decode(torch.stack(parts[1:]).sum(dim=0)) == {
        k: v for k, v in values.items() if k % 3}
