"""One `ProtocolState`: a standby's join and a relaunch from node snapshots resume the same
protocol state, straggler history and committed reserve ids included; a checkpoint carries it as
plain values (`torch.load(weights_only=True)`), and a previous release's checkpoint still loads.

Run: .venv/bin/python -m pytest tests/unit/test_protocol_state.py   (no MPI; seconds)

The state comes from a real `WorkloadPolicy` driven through a failure with reserve ids
committed, a second failure, and a replica slow for a window (a balanced layout, a marked
replica); the trainer around it is the four attributes `capture` reads. The join side goes
through `transfer.broadcast_state`, what `standby.transfer` sends a joiner with (its structure
pickled, its tensors in packs), over a two-member group of threads; the snapshot side through
the snapshot writer (`snapshot.Snapshots`) and `snapshot.restore` in a one-rank gloo world.
"""

import dataclasses
import json
import queue
import tempfile
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_recover.megatron.persistence import torch_format as checkpoint, snapshots as snapshot
from megatron_recover.policy import Layout, PolicyConfig, WorkloadPolicy
from megatron_recover.policy.adaptive import AdaptiveLayout
from megatron_recover.policy.speed import SpeedState, StragglerConfig
from megatron_recover.recovery.membership import transfer
from megatron_recover.recovery.protocol_state import (
    ProtocolState,
    capture,
    resume_policy,
)

pytestmark = pytest.mark.unit

CONFIG = PolicyConfig(w_init=5, g_init=2, mode="reserve", straggler=StragglerConfig(0.25, 2))
SLOW = {0: 1.0, 1: 2.5, 2: 1.0, 3: 1.0}  # replica 1 is 2.5x slower than the others


def drive(policy: WorkloadPolicy, iterations) -> set[int]:
    """Run `iterations` ((failed replicas, times) each) on `policy`; the reserve ids they
    committed."""
    reserve = set()
    for failed, times in iterations:
        policy.begin()
        if failed:
            policy.on_failure(failed)
        result = policy.commit(times or {r: 1.0 for r in policy.layout.replicas})
        reserve |= {i for i in result.committed if i >= policy.config.b}
    return reserve


def busy_trainer():
    """A trainer after 7 iterations: replica 4 died in iteration 2 and replica 0 in 4 (reserve
    ids committed then), replica 1 slow from iteration 5 (marked, a balanced layout from 6)."""
    policy = WorkloadPolicy(CONFIG)
    reserve = drive(policy, [((), None), ({4}, None), ((), None), ({0}, None),
                             ((), SLOW), ((), SLOW), ((), SLOW)])
    trainer = SimpleNamespace(
        p=SimpleNamespace(policy=policy, replica_of_rank={2: 1, 3: 2, 4: 3},
                          audit=SimpleNamespace(committed_reserve=frozenset(reserve))),
        dead_replicas={0, 4})
    return trainer


def assert_same(a: ProtocolState, b: ProtocolState) -> None:
    """Field by field (a field added later is compared too)."""
    for f in dataclasses.fields(ProtocolState):
        assert getattr(a, f.name) == getattr(b, f.name), f.name
    assert a == b


class ThreadPair:
    """Two members of a group (world ranks 0 and 1) on threads, with the one operation
    `transfer.broadcast_state` uses; the donor's tensor goes over a queue."""

    def __init__(self):
        self.wire = queue.Queue()

    def member(self, rank: int):
        pair = self

        class Member:
            members = [0, 1]
            epoch = 0

            @property
            def rank(self):
                return rank

            def broadcast(self, tensor, donor):
                if rank == donor:
                    pair.wire.put(tensor.clone())
                else:
                    tensor.copy_(pair.wire.get(timeout=30))
                return SimpleNamespace(wait=lambda: SimpleNamespace(has_failure=False))

        return Member()


def join_transfer(state: dict) -> dict:
    """What a joiner receives of `state` from its donor (`standby.transfer`'s broadcast)."""
    pair, received = ThreadPair(), {}

    def joiner():
        received["state"], received["ok"] = transfer.broadcast_state(
            pair.member(1), 0, None)

    thread = threading.Thread(target=joiner)
    thread.start()
    _, ok = transfer.broadcast_state(pair.member(0), 0, state)
    thread.join(30)
    assert ok and received["ok"]
    return received["state"]


def snapshot_relaunch(tmp_path, iteration: int, state: dict, monkeypatch) -> ProtocolState:
    """Write `state` with the snapshot writer, then resume from it as a relaunch does
    (`snapshot.restore` in a one-rank gloo world; the model part is not installed)."""
    writer = snapshot.Snapshots(tmp_path / "shm", 1, (0, 0), replica=1)
    writer.take(iteration, state)
    writer.finish()
    installed = []
    monkeypatch.setattr(snapshot.training_state, "restore",
                        lambda saved, *parts: installed.append(saved["weights"]))
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0,
                                world_size=1)
        try:
            group = SimpleNamespace(members=[0])
            resumed = snapshot.restore(tmp_path / "shm", group, (0, 0), None, None, None)
        finally:
            dist.destroy_process_group()
    assert len(installed) == 1 and torch.equal(installed[0], state["weights"])
    return resumed


def test_a_join_and_a_snapshot_relaunch_resume_the_same_protocol_state(tmp_path, monkeypatch):
    trainer = busy_trainer()
    original = capture(trainer, 7)
    # The state is not trivial: each part a relaunch used to lose is there.
    assert original.speeds.marked == {1} and original.speeds.quotas == {1: 2, 2: 4, 3: 4}
    assert original.layout.quotas == (2, 4, 4) and original.reserve_next == 5
    assert original.committed_reserve == {10, 11, 12, 13, 14}
    assert original.dead_replicas == {0, 4} and original.last_committed == 7

    training = {"position": (0, 0), "weights": torch.arange(6.0), "digests": {"params": "x"}}
    joined = join_transfer({**training, "protocol": original.state_dict()})
    by_join = ProtocolState.from_state_dict(joined["protocol"])
    by_relaunch = snapshot_relaunch(tmp_path, 7, {**training,
                                                  "protocol": original.state_dict()},
                                    monkeypatch)
    assert isinstance(by_relaunch, ProtocolState)
    assert_same(by_join, original)
    assert_same(by_relaunch, original)
    assert_same(by_join, by_relaunch)

    # Both continue exactly as the run they came from: the same layouts and speed history
    # after the next commits (the marked replica stays marked, its quotas stay).
    policies = [trainer.p.policy, resume_policy(by_join, CONFIG),
                resume_policy(by_relaunch, CONFIG)]
    assert len({id(p.speeds) for p in policies}) == 3
    for policy in policies:
        drive(policy, [((), SLOW), ((), {1: 1.0, 2: 1.0, 3: 1.0})])
    after = [ProtocolState.of_policy(p, 9) for p in policies]
    assert_same(after[1], after[0])
    assert_same(after[2], after[0])
    assert after[0].speeds.marked == {1}


def test_a_checkpoint_holds_plain_values_that_weights_only_reads(tmp_path):
    original = capture(busy_trainer(), 7)
    torch.save({"recover_state": original.state_dict()}, tmp_path / "common.pt")
    saved = torch.load(tmp_path / "common.pt", weights_only=True)["recover_state"]
    assert_same(ProtocolState.from_state_dict(saved), original)
    # Committed reserve ids go as spans, gaps kept.
    gappy = dataclasses.replace(original, committed_reserve={10, 11, 12, 20, 22, 23})
    assert gappy.state_dict()["committed_reserve"] == [[10, 13], [20, 21], [22, 24]]
    assert_same(ProtocolState.from_state_dict(gappy.state_dict()), gappy)
    # recover_state.json, for people.
    checkpoint.write_summary(tmp_path, original)
    summary = json.loads((tmp_path / "recover_state.json").read_text())
    assert summary["live_replicas"] == [1, 2, 3] and summary["b"] == 10
    assert summary["roles"] == {"1": "major", "2": "major", "3": "major"}
    assert summary["speeds"]["marked"] == [1] and summary["committed_reserve_count"] == 5


def previous_release(layout, policy="static", mode="reserve", **extra) -> dict:
    """A checkpoint's `recover_state` as the previous release wrote it
    (`RecoveryState.to_dict()`)."""
    return {"iteration": 7, "b": 10, "w_init": 5, "g_init": 2, "policy": policy, "mode": mode,
            "layout": dataclasses.asdict(layout), "reserve_next": 5,
            "live_replicas": layout.replicas, "ramp": (), **extra}


def test_a_previous_release_checkpoint_loads_with_neutral_values(tmp_path):
    layout = Layout(b=10, g_cur=4, r_cur=0, majors=(1, 2, 3), minor=None, quotas=(2, 4, 4))
    torch.save(previous_release(layout), tmp_path / "old.pt")
    state = ProtocolState.from_state_dict(torch.load(tmp_path / "old.pt", weights_only=True))
    assert (state.iteration, state.b, state.w_init, state.g_init, state.policy, state.mode,
            state.reserve_next, state.live_replicas, state.ramp) == (
        7, 10, 5, 2, "static", "reserve", 5, (1, 2, 3), ())
    assert state.layout == layout
    # What the previous release did not keep takes its neutral value.
    assert state.last_committed == 7 and state.dead_replicas == frozenset()
    assert state.replica_of_rank == {} and state.speeds == SpeedState()
    assert state.committed_reserve == frozenset()
    policy = resume_policy(state, CONFIG)
    assert (policy.layout, policy.last_committed, policy.reserve_next, policy.speeds) == (
        layout, 7, 5, SpeedState())
    # Older still: no ramp, a layout without quotas; JSON-like lists; the adaptive layout.
    plain = Layout(b=10, g_cur=4, r_cur=2, majors=(1, 2), minor=3)
    older = previous_release(plain)
    del older["ramp"], older["layout"]["quotas"]
    older["layout"]["majors"] = list(older["layout"]["majors"])
    assert ProtocolState.from_state_dict(older).layout == plain
    adaptive = AdaptiveLayout(g_cur=2, replicas=(1, 2, 3))
    state = ProtocolState.from_state_dict(previous_release(adaptive, "adaptive", "exact"))
    assert state.layout == adaptive
    # A key this release does not know is refused, not dropped.
    with pytest.raises(ValueError, match="unknown keys \\['lease'\\]"):
        ProtocolState.from_state_dict(previous_release(layout, lease=3))


def test_a_relaunch_on_other_replicas_forgets_their_history():
    state = capture(busy_trainer(), 7)
    # Four replicas again: id 0 comes back (a vacant id), the layout is Algorithm 7's, the
    # quotas go (the live set changed), the survivors' histories stay.
    policy = resume_policy(state, CONFIG, [0, 1, 2, 3])
    assert policy.layout.replicas == (0, 1, 2, 3) and not policy.layout.quotas
    assert set(policy.speeds.replicas) == {1, 2, 3} and policy.speeds.marked == {1}
    assert policy.speeds.quotas == {} and policy.last_committed == 7
    # Two replicas at launch of the relaunch (G_init 5): B is kept, W_init is the run's.
    policy = resume_policy(state, PolicyConfig(w_init=2, g_init=5, mode="reserve"), [1, 2])
    assert policy.config.w_init == 5 and policy.layout.replicas == (1, 2)
    assert set(policy.speeds.replicas) == {1, 2} and policy.speeds.marked == {1}
    with pytest.raises(ValueError, match="this run B = 12"):
        resume_policy(state, PolicyConfig(w_init=4, g_init=3, mode="reserve"))
    with pytest.raises(ValueError, match="in exact mode"):
        resume_policy(state, dataclasses.replace(CONFIG, mode="exact"))
    with pytest.raises(ValueError, match="captured between iterations"):
        policy.begin()
        ProtocolState.of_policy(policy, 7)
