"""The two sides of a standby join in a training run (the protocol: standby.py, steps 1-4).

A training rank calls idle standbys into vacant replica ids between iterations (`grow_back`)
and sends them its complete training state; a standby waits for a call and receives it
(`wait_for_call`), after which run.py builds its trainer from that state (`continue_as_joiner`)
as a live replica's is.
"""

import time
from dataclasses import dataclass

from megatron_recover.recovery.membership import standby
from megatron_recover.megatron.persistence import training_state
from megatron_recover.megatron.app.rank_setup import RankSetup
from megatron_recover.recovery import ResilientTrainer
from megatron_recover.recovery.membership import transfer
from megatron_recover.recovery.protocol_state import ProtocolState, capture


def state_digests(setup: RankSetup) -> dict:
    """What a joiner must hold exactly as its donor (`state.digests`)."""
    return training_state.digests(setup.unwrapped_model(), setup.optimizer)


def join_state(trainer: ResilientTrainer, setup: RankSetup, iteration: int) -> dict:
    """Everything a joiner needs to continue after `iteration` as a live replica does: the
    complete training state (`state.capture`) and the protocol's (`ProtocolState.state_dict()`
    under `protocol`, as checkpoints and snapshots carry it)."""
    trainer.gather_parameters()
    return {"position": setup.checkpoint_position,
            **training_state.capture(setup.chunks, setup.optimizer, setup.scheduler),
            "protocol": capture(trainer, iteration).state_dict(),
            "digests": state_digests(setup)}


def grow_back(w_init: int, trainer: ResilientTrainer, setup: RankSetup, pool: standby.Pool,
              iteration: int) -> None:
    """(training ranks, after `iteration`) Call idle standbys into the vacant replica ids; the
    outcome is reported with the next iteration."""
    policy = trainer.p.policy
    vacant = sorted(set(range(w_init)) - set(policy.layout.replicas))
    if not vacant or not pool.idle:
        return
    event = {"event": "join", "replicas": [], "ranks": [], "called": time.time(),
             "after_iteration": iteration}
    pool.joins += 1
    message = {"join": pool.joins, "iteration": iteration, "idle": list(pool.idle),
               "vacant": vacant}
    pool.send(message)
    assignment, grown, ok, candidates = pool.assemble(message, member=True,
                                                      position=setup.local_rank)
    group, replica_group = setup.group, setup.control_group
    lost = []
    if ok and assignment:
        settled = standby.adopt(group, grown, replica_group, w_init, assignment)
        lost = standby.drop_members(group, settled.dropped)
        ok = bool(settled.joined)
    # Whoever was assigned joined, or left (dropped), or goes back to waiting (not adopted
    # anywhere: `Settled.present` is empty then, on the standbys' side too).
    pool.idle = candidates if not (ok and assignment) else [r for r in candidates
                                                            if r not in assignment]
    if not (ok and assignment):
        _abandon(trainer, event, lost)
        return
    state = join_state(trainer, setup, iteration)
    trainer.p.faults.arm_join(group, iteration)
    _, alive, lost_here = standby.transfer(group, assignment, state)
    lost += lost_here  # since the adoption: every position learns of them in `settle`
    dead = {trainer.p.replica_of_rank[r] for r in lost if r in trainer.p.replica_of_rank}
    settled = standby.settle(replica_group, w_init, assignment, group.members, alive, dead)
    # A survivor lost while a dropped joiner leaves is known at this position only (untested,
    # with M > 1: the other positions learn of its replica at the next iteration's verdict).
    lost += standby.drop_members(group, settled.dropped)
    joined = settled.joined
    failure = trainer.grow(joined, lost, settled.dead)
    if failure is not None:
        trainer.add_event(failure)
    if not joined:
        _abandon(trainer, event, lost)
        return
    trainer.add_event({**event, "replicas": sorted(set(joined.values())),
                       "ranks": sorted(joined), "epoch": setup.group.epoch,
                       "state_received": time.time()})


def _abandon(trainer: ResilientTrainer, event: dict, lost: list[int]) -> None:
    trainer.add_event({**event, "event": "join-abandoned", "lost": lost,
                       "abandoned": time.time()})


@dataclass
class Call:
    """A standby's join, once it holds the state (`wait_for_call`)."""

    state: dict  # its donor's `join_state`
    protocol: ProtocolState  # ... its protocol state
    replica_index: int  # the replica id it took
    joined: dict[int, int]  # world rank -> replica id: every rank that joined with it
    lost: list[int]  # ranks lost during the join
    dead: set[int]  # replicas that lost a rank at another position
    called: float  # time.time() of the call
    received: float  # ... and of the state's arrival


def wait_for_call(w_init: int, setup: RankSetup, pool: standby.Pool, faults,
                  leave) -> Call | None:
    """(standby) Wait for a call, join, take the state; None when dismissed or when nobody is
    left to call. `faults`: the standby's own failure-schedule points; `leave(reason)` ends this
    rank (a join that did not take at every position of its replica)."""
    faults.idle()
    # The replica's own ranks, to combine the positions' outcomes (standby.settle).
    replica_group = setup.control_group
    group = setup.group
    while True:
        message = pool.wait_for_call()
        if message is None:
            return None
        called = time.time()
        assignment, grown, ok, candidates = pool.assemble(message, member=False,
                                                          position=setup.local_rank)
        pool.idle = [r for r in candidates if r not in assignment]
        if not ok or pool.rank not in assignment:
            continue
        settled = standby.adopt(group, grown, replica_group, w_init, assignment)
        if assignment[pool.rank] not in settled.present:
            pool.idle = candidates  # adopted nowhere: every group is as it was
            continue
        if pool.rank not in settled.joined:  # its group grew at some position, not at all
            leave("join abandoned: the grown groups did not take at every position")
        lost = standby.drop_members(group, settled.dropped)
        faults.arm_join(group, message["iteration"])
        state, alive, lost_here = standby.transfer(group, assignment, None)
        lost += lost_here
        break
    received = time.time()
    if state["position"] != setup.checkpoint_position:
        raise RuntimeError(f"standby join: the state received is of position "
                           f"{state['position']}, this rank's is {setup.checkpoint_position}")
    protocol = ProtocolState.from_state_dict(state["protocol"])
    dead = {protocol.replica_of_rank[r] for r in lost if r in protocol.replica_of_rank}
    settled = standby.settle(replica_group, w_init, assignment, group.members, alive, dead)
    if pool.rank not in settled.joined:
        leave("join abandoned: the state did not reach every position of this replica")
    lost += standby.drop_members(group, settled.dropped)
    return Call(state, protocol, assignment[pool.rank], settled.joined, lost, settled.dead,
                called, received)


def continue_as_joiner(trainer: ResilientTrainer, call: Call, setup: RankSetup,
                       pool: standby.Pool) -> tuple[int, dict]:
    """(standby, its trainer built from `call.state`) Take the join into the trainer: (the first
    iteration to run, the join as this rank saw it)."""
    failure = trainer.grow(call.joined, call.lost, call.dead)
    if failure is not None:
        trainer.add_event(failure)
    event = {"event": "join", "replicas": sorted(set(call.joined.values())),
             "ranks": sorted(call.joined), "epoch": setup.group.epoch, "called": call.called,
             "state_received": call.received, "after_iteration": call.protocol.iteration}
    trainer.add_event(dict(event))
    return call.protocol.iteration + 1, {
        **event, "replica": setup.replica_index,
        "state_bytes": transfer.tensor_bytes(call.state), "waited_s": pool.waited_s,
        "wait_cpu_s": pool.wait_cpu_s, "donor_digests": call.state["digests"],
        "digests": state_digests(setup), "contributions": {}}
