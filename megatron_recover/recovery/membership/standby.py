"""Standby replicas: wait without a busy core, then grow the job back (--recover-standby-replicas).

A job with K standbys runs K replicas more than the training ones, as the last MPI ranks (a standby
replica is M consecutive ranks: TP x PP, or TP x PP x S for a distributed-optimizer instance of S
shards). A standby builds its model and optimizer like any replica (in a torch.distributed world of
its own, so megatron's parallel state of the training ranks is the one without standbys; a standby
instance is that world's one instance), then waits on the pool communicator (a duplicate of
MPI_COMM_WORLD made by every rank at start-up) with a non-blocking receive polled every POLL_S: it
joins no collective and uses no core while waiting.

Growing back, after an iteration boundary at which the policy's layout has fewer replicas than
W_init (`grow_back`, on every training rank alike: the decision is a function of the policy):

  1. Call-up. Every survivor sends the same message to every idle standby rank: the join's
     sequence number, the idle standby ranks and the vacant replica ids. A standby takes the
     first message of a join and drops the copies.
  2. Assembly. Survivors and every idle standby shrink the pool communicator (a fault-tolerant
     collective: whoever died is left out, whenever it died), so all hold the same set of live
     processes, and assign the standby replicas whose M ranks are all alive to the vacant ids
     in order. They split it into one grown group per intra-replica position (the survivors'
     and the assigned standbys' ranks at that position; the others go back to waiting) and
     agree on the pool that every split succeeded; then each member hands the grown
     communicator to its position's ulfm group (`ULFMGroup.adopt`, a second agreement, over
     the grown group). With M > 1 the positions' outcomes are then combined over each
     replica's own ranks (`Settled`): a joiner whose replica did not take at every position
     leaves, and the survivors wait until its ranks are gone from their groups.
     `MPI_Comm_create_from_group` would need no shrink, but a member that is dead when it is
     called crashes the live ones inside Open MPI 5.0.11 (SIGSEGV in ompi_comm_revoke_local),
     so it is not used.
  3. State transfer. At each position the lowest surviving member broadcasts its complete
     training state (its shard of the model and optimizer) on the grown group; a failure during
     it is repaired like any other (a dead donor is replaced by the next survivor, a dead joiner
     drops out) and the transfer is repeated until a consensus shows that every live member
     holds it. The positions' outcomes are combined as in step 2: a replica id joins only where
     its joiner took the state at every position, and a replica that lost a rank anywhere is
     dropped everywhere.
  4. Every member grows the policy by the joined ids; the next iteration runs on the grown
     layout with B unchanged.

A failed assembly leaves every group as it was (both agreements are uniform), and the survivors
try again at the next boundary. An idle standby leaves when the survivors dismiss it at the end
of training, or when every process that could call it is dead (checked every LIVENESS_S).
"""

import pickle
import time
from dataclasses import dataclass, field

import torch

from megatron_recover.mpi import failed_ranks, mpi
from megatron_recover.recovery.membership.transfer import broadcast_state

CALL_TAG = 7101
POLL_S = 0.005
LIVENESS_S = 0.25



@dataclass
class Pool:
    """Every rank's view of the standbys: the same on all training ranks (a function of agreed
    outcomes); a standby refreshes its own from each call-up."""

    comm: object  # the pool communicator (a duplicate of MPI_COMM_WORLD, errors returned)
    idle: list[int]  # MPI ranks of the standbys not (yet) called, as far as this rank knows
    first: int  # the first standby rank (= the training ranks)
    unit: int  # ranks per replica (M): a standby replica is `unit` consecutive ranks
    joins: int = 0  # call-ups so far (a call-up's sequence number)
    # (standby) Seconds spent waiting for calls, and the process CPU seconds meanwhile.
    waited_s: float = 0.0
    wait_cpu_s: float = 0.0
    end_reason: str = ""  # (standby) why wait_for_call returned None
    _keep: list = field(default_factory=list)  # communicators the ulfm groups hold
    _sends: list = field(default_factory=list)

    @classmethod
    def open(cls, training_ranks: int, ranks_per_replica: int) -> "Pool":
        """Collective over MPI_COMM_WORLD (at start-up, on every rank); MPI ranks from
        `training_ranks` on are the standbys, `ranks_per_replica` to a standby replica."""
        MPI = mpi()
        comm = MPI.COMM_WORLD.Dup()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        return cls(comm, list(range(training_ranks, comm.Get_size())), training_ranks,
                   ranks_per_replica)

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    def send(self, message: dict) -> None:
        """To every idle standby; never waits (a dead standby's copy is simply lost)."""
        data = pickle.dumps(message)
        for standby in self.idle:
            try:
                self._sends.append(self.comm.Isend(data, standby, CALL_TAG))
            except mpi().Exception:
                pass

    def wait_for_call(self) -> dict | None:
        """(standby) The next call-up, or None once dismissed or when every process that could
        call is dead. Polls: under 1% of a core (docs/ulfm-behaviour.md, "Adding ranks: standby
        replicas")."""
        start, cpu = time.monotonic(), time.process_time()
        try:
            return self._wait()
        finally:
            self.waited_s += time.monotonic() - start
            self.wait_cpu_s += time.process_time() - cpu

    def _wait(self) -> dict | None:
        MPI = mpi()
        buffer = bytearray(1 << 16)
        request = self.comm.Irecv(buffer, MPI.ANY_SOURCE, CALL_TAG)
        checked = time.monotonic()
        while True:
            try:
                done = request.Test()
            except MPI.Exception:  # a process died: acknowledge it and keep receiving
                self.comm.Ack_failed()
                done = False
            if done:
                message = pickle.loads(bytes(buffer))
                if message.get("end"):
                    self.end_reason = "dismissed at the end of training"
                    return None
                if message["join"] > self.joins:
                    return message
                request = self.comm.Irecv(buffer, MPI.ANY_SOURCE, CALL_TAG)  # a copy
                continue
            if time.monotonic() - checked > LIVENESS_S:
                checked = time.monotonic()
                if not self._callers_alive():
                    request.Cancel()
                    self.end_reason = "every process that could call it is gone"
                    return None
            time.sleep(POLL_S)

    def _callers_alive(self) -> bool:
        """Whether any process other than the idle standbys is still alive."""
        callers = set(range(self.comm.Get_size())) - set(self.idle) - {self.rank}
        return bool(callers - failed_ranks(self.comm))

    def assemble(self, message: dict, member: bool, position: int):
        """Step 2 of the module docstring, on survivors (`member`) and idle standbys alike;
        `position`: this rank's place in its replica (0..M-1, the same numbering in every
        replica). Returns (assignment: the MPI rank of every rank of an assigned standby
        replica -> its replica id, this position's grown communicator or None when this rank
        is not in it, ok: whether every split succeeded, the ranks of the idle standby replicas
        that were alive). The caller settles `idle` once it knows who joined."""
        MPI = mpi()
        self.joins = message["join"]
        shrunk = self.comm.Shrink()
        shrunk.Set_errhandler(MPI.ERRORS_RETURN)
        alive = set(MPI.Group.Translate_ranks(shrunk.Get_group(), list(range(shrunk.Get_size())),
                                              self.comm.Get_group()))
        units = {}
        for rank in message["idle"]:
            units.setdefault((rank - self.first) // self.unit, []).append(rank)
        whole = [sorted(ranks) for _, ranks in sorted(units.items())
                 if len(ranks) == self.unit and alive.issuperset(ranks)]
        candidates = [rank for ranks in whole for rank in ranks]
        assignment = {rank: replica for ranks, replica in zip(whole, message["vacant"])
                      for rank in ranks}
        member = member or self.rank in assignment
        grown, ok = None, 1
        try:
            grown = shrunk.Split(position if member else MPI.UNDEFINED, self.rank)
        except MPI.Exception:
            ok = 0
        try:
            ok = shrunk.Agree(ok)
        except MPI.Exception:  # someone died during the split: uniform, so nobody goes on
            ok = 0
        if grown is not None and grown != MPI.COMM_NULL:
            if not ok:
                grown.Revoke()
            self._keep.append(grown)
        else:
            grown = None
        self._keep.append(shrunk)
        return assignment, grown, bool(ok), candidates

    def dismiss(self, timeout_s: float = 10.0) -> None:
        """(survivors, at the end of training) Let the idle standbys leave: the messages are
        out before this rank exits (or `timeout_s` passed: a standby that is gone meanwhile
        never takes its copy, and the others' copies suffice)."""
        self.send({"end": True})
        end = time.monotonic() + timeout_s
        pending = list(self._sends)
        while pending and time.monotonic() < end:
            try:
                pending = [r for r in pending if not r.Test()]
            except mpi().Exception:
                pending = []  # a receiver died: its copy does not matter any more
            time.sleep(POLL_S)


@dataclass(frozen=True)
class Settled:
    """A join step's outcome at one position, made equal on every rank of a replica: a
    position's outcome is the same on all of its group's members, and every replica has one
    rank at each position, so the union over a replica's ranks is the same in every replica."""

    joined: dict[int, int]  # this position's joiner ranks that join -> their replica id
    dead: set[int]  # replica ids that lost a rank at some position meanwhile
    dropped: list[int]  # this position's joiner ranks whose replica did not take everywhere
    present: set[int]  # replica ids whose joiner is in some position's group


def settle(replica_group, w_init: int, assignment: dict[int, int], members: list[int],
           holding: list[int], dead_here: set[int]) -> Settled:
    """Combine the positions' outcomes (module docstring, steps 2 and 3). `members`: this
    position's group members; `holding`: the assigned ranks in it that took this step (hold
    the grown communicator, or the state); `dead_here`: replica ids of the live layout that
    lost a rank in this position's group meanwhile. Every rank of a replica calls it
    (`replica_group` None: a replica of one rank)."""
    assigned = set(assignment.values())
    flags = torch.zeros(3 * w_init, dtype=torch.float64)
    for replica in assigned - {assignment[r] for r in holding if r in assignment}:
        flags[replica] = 1  # not taken at this position
    for replica in dead_here:
        flags[w_init + replica] = 1
    for rank in members:
        if rank in assignment:
            flags[2 * w_init + assignment[rank]] = 1
    if replica_group is not None:
        # A peer that died makes this raise; the exit hook then takes this rank down too.
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX,
                                     group=replica_group)
    taken = {r for r in assigned if flags[r] == 0}
    here = [r for r in members if r in assignment]
    return Settled(joined={r: assignment[r] for r in here if assignment[r] in taken},
                   dead={r for r in range(w_init) if flags[w_init + r] > 0},
                   dropped=sorted(r for r in here if assignment[r] not in taken),
                   present={r for r in range(w_init) if flags[2 * w_init + r] > 0})


def adopt(group, grown, replica_group, w_init: int, assignment: dict[int, int]) -> Settled:
    """The end of step 2 on a member of a grown group (survivor or assigned standby): hand
    `grown` to this position's ulfm group, then combine the positions' outcomes."""
    adopted = group.adopt(grown).wait().census[0] == 1
    members = group.members if adopted else []
    return settle(replica_group, w_init, assignment, members, members, set())


def drop_members(group, ranks: list[int]) -> list[int]:
    """Wait until `ranks` (joiners that leave: `Settled.dropped`) are gone from `group`: a
    consensus, repeated, on every remaining member alike. Returns every member lost."""
    lost = []
    while any(r in group.members for r in ranks):
        lost += group.consensus([1]).wait().failed_ranks
    return sorted(lost)


def transfer(group, assignment: dict[int, int], state: dict | None) -> tuple[
        dict | None, list[int], list[int]]:
    """Step 3: broadcast the training state (`state`: given on every survivor, None on joiners)
    from the lowest surviving member, tensor by tensor (`transfer.broadcast_state`), until
    every live member holds it; the joiners are the assigned ranks in `group`. Returns (the
    state: a joiner's received one, a survivor's own; the joiners still alive; every member
    lost meanwhile), the same lists on every member. Every member of the grown group calls it."""
    joiners = sorted(r for r in assignment if r in group.members)
    me = group.members[group.rank]
    lost = []
    while True:
        donor = min(m for m in group.members if m not in joiners)
        # Survivors keep their own state: the donor's passes through one scratch buffer there.
        received, ok = broadcast_state(group, donor, state,
                                                      keep=me in joiners)
        agreed = group.consensus([int(ok)]).wait()
        lost += agreed.failed_ranks
        joiners = [j for j in joiners if j in group.members]
        if not agreed.failed_ranks and agreed.census[0] == agreed.size:
            return (received if state is None else state), joiners, sorted(lost)
        if not joiners:
            return state, joiners, sorted(lost)
