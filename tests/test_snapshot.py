"""In-memory snapshots and the relaunching launcher, without MPI: the writer's two buffers and
completion marker, the relaunch's choice of iteration, the hostfile, the stall bound, lost hosts,
the remote launcher (agent, Slurm step, ssh), what the launcher reports of ranks that died
without a status.

Run: `make test`. CPU only, one process; tests/test_node_loss.py runs the same code on 3 nodes.
"""

import socket

import torch

from megatron_recover import relaunch
from megatron_recover.megatron.persistence import snapshots as snapshot


def files(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def test_the_writer_keeps_the_newest_complete_snapshot_until_the_next_is(tmp_path):
    writer = snapshot.Snapshots(tmp_path, 2, (0, 0), replica=3, replicas_here=[1, 3])
    # Replica 1 writes this node's copy while it lives, then replica 3.
    assert not writer.due(2, [0, 1, 3]) and writer.due(2, [0, 3]) and not writer.due(3, [3])
    weight = torch.zeros(4)
    other = tmp_path / "iter_0000002" / "mp_rank_01_000-replica_0001.pt"
    for iteration in (2, 4, 6):
        weight += 1
        writer.take(iteration, {"model": {"weight": weight}})
        writer.wait()
        if iteration == 2:  # another position's writer on this node, a snapshot behind
            other.write_bytes(b"its newest complete snapshot")
    # This writer's file of iteration 2 went once 6's was complete; 4's stays until 8's is.
    # The other writer's file stays: it is not this writer's to remove.
    assert files(tmp_path) == ["iter_0000002/mp_rank_01_000-replica_0001.pt",
                               "iter_0000004/mp_rank_00_000-replica_0003.pt",
                               "iter_0000006/mp_rank_00_000-replica_0003.pt"]
    saved = torch.load(tmp_path / files(tmp_path)[2], weights_only=False)
    assert saved["iteration"] == 6 and saved["model"]["weight"].tolist() == [3.0] * 4
    weight += 1  # the copy was taken at the boundary: later updates do not reach it
    assert torch.load(tmp_path / files(tmp_path)[2], weights_only=False)["model"][
        "weight"].tolist() == [3.0] * 4
    writer.finish()  # the files stay for a relaunch: the job may still lose a node
    assert len(files(tmp_path)) == 3


def test_a_slow_write_is_torn_until_it_completes(tmp_path):
    paused = []
    writer = snapshot.Snapshots(tmp_path, 2, (1, 0, 1), replica=0, slow_writes={4: 0.5},
                                on_pause=paused.append)
    assert writer.due(4, [0, 1])
    writer.take(2, {"model": {"w": torch.ones(1000)}})
    writer.wait()
    writer.take(4, {"model": {"w": torch.ones(1000)}})
    while not paused:
        pass
    # Halfway through: only a temporary file, never counted as complete.
    assert "iter_0000004/mp_rank_01_000_shard_01-replica_0000.tmp" in files(tmp_path)
    assert snapshot.inventory(tmp_path) == {2: {"mp_rank_01_000_shard_01"}}
    writer.wait()
    assert snapshot.inventory(tmp_path) == {2: {"mp_rank_01_000_shard_01"},
                                            4: {"mp_rank_01_000_shard_01"}}


def test_the_relaunch_takes_the_newest_iteration_every_position_holds():
    a, b = "mp_rank_00_000", "mp_rank_01_000"
    # (host, the rank's position, its node's files): a TP=2 job on two nodes.
    ranks = [("n0", a, {4: {a, b}, 6: {a}}), ("n0", b, {4: {a, b}, 6: {a}}),
             ("n1", a, {4: {a, b}, 6: {a, b}}), ("n1", b, {4: {a, b}, 6: {a, b}})]
    assert snapshot.choose(ranks) == 6
    # n1 lost: 6 lacks position b on the survivors (torn there), 4 is complete.
    assert snapshot.choose(ranks[:2]) == 4
    # A spare host brings no files, and a file of another position does not count.
    spare = [("n2", a, {}), ("n2", b, {})]
    assert snapshot.choose(ranks[:2] + spare) == 4
    assert snapshot.choose([("n0", a, {6: {b}}), ("n0", b, {})]) is None
    # b's file is on n0, but b's only rank is on n1: the state moves within a position's group.
    assert snapshot.choose([("n0", a, {6: {a, b}}), ("n1", b, {})]) is None
    assert snapshot.choose(spare) is None


def test_hostfile_and_stall_bound(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job's nodes\nnode1 slots=8\nnode2 slots=8  # second\n\nnode3\n")
    assert relaunch.read_hostfile(hostfile) == [("node1", 8), ("node2", 8), ("node3", 1)]
    assert relaunch.stall_timeout(["x", "--recover-hang-timeout", "5"]) == 55
    assert relaunch.stall_timeout(["x", "--recover-hang-timeout=0"]) == 11 * 60
    assert relaunch.stall_timeout(["x"]) == 11 * 60


def test_lost_hosts_from_either_prterun_message():
    """prterun names the node of a lost daemon in two messages; `true` stands in for ssh (every
    host answers), so the message is the only evidence."""
    here = socket.gethostname()
    statuses = {r: {"state": "running"} for r in range(4)}
    for message in ("  Remote daemon: [prterun-x@0,1] on node nodeX\n",
                    "  Local host:    x\n  Remote host:   nodeX\n  Daemon exit status: 137\n"):
        attempt = relaunch.Attempt(1, [here, "nodeX"], "id", 0.0, statuses=statuses,
                                   lines=[(0.0, "A daemon failed\n"), (0.0, message)])
        assert relaunch.lost_hosts(attempt, 2, "true", {}) == {"nodeX": "PRRTE lost its daemon"}
    # No rank of nodeX started, and nothing else is known: that is the evidence.
    attempt = relaunch.Attempt(1, [here, "nodeX"], "id", 0.0, statuses={0: {}, 1: {}})
    assert relaunch.lost_hosts(attempt, 2, "true", {}) == {"nodeX": "no rank started"}
    # nodeX did not answer the clean-up of the ranks: it is not asked again (`true` would
    # answer for it).
    attempt = relaunch.Attempt(1, [here, "nodeX"], "id", 0.0, statuses=statuses,
                               unreachable={"nodeX"})
    assert relaunch.lost_hosts(attempt, 2, "true", {}) == {"nodeX": "unreachable"}


def test_a_rank_that_died_without_a_status_is_reported_by_its_signal():
    """A rank killed by a signal writes no status; the summary quotes Open MPI's report of it,
    however much mpirun printed after it."""
    report = ["[vm:123] *** Process received signal ***\n", "[vm:123] Signal: Aborted (6)\n",
              "[vm:123] [ 0] /lib/libc.so.6(+0x42520)\n", "[vm:123] *** End of error message ***\n"]
    after = [f"later line {i}\n" for i in range(40)]
    attempt = relaunch.Attempt(1, ["vm"], "id", 0.0, timed_out=True,
                               statuses={0: {"state": "running"}, 1: {"state": "running"}},
                               lines=[(0.0, line) for line in ["start\n", *report, *after]])
    summary = attempt.summary()
    assert "Signal: Aborted (6)" in summary and "End of error message" in summary, summary
    assert "later line 39" in summary and "later line 20" not in summary, summary
    quiet = relaunch.Attempt(1, ["vm"], "id", 0.0, timed_out=True, statuses={0: {}},
                             lines=[(0.0, line) for line in after])
    assert "..." not in quiet.summary() and "later line 34" in quiet.summary()


def test_remote_commands_go_through_the_agent_slurm_or_ssh():
    """The launcher's remote launcher: the --ssh-agent stand-in when given; inside a Slurm
    allocation (SLURM_JOB_ID in the environment) a one-task step on that node beside the job's
    others; ssh otherwise. tests/test_slurm.py runs the Slurm form on a cluster."""
    assert relaunch.remote_argv("n2", "true", "/a/agent", {"SLURM_JOB_ID": "7"}) == [
        "/a/agent", "n2", "true"]
    step = relaunch.remote_argv("n2", "kill -KILL 5", None, {"SLURM_JOB_ID": "7"})
    assert step[0] == "srun" and "--nodelist=n2" in step and "--overlap" in step
    assert step[-3:] == ["/bin/sh", "-c", "kill -KILL 5"]
    ssh = relaunch.remote_argv("n2", "true", None, {})
    assert ssh[0] == "ssh" and ssh[-2:] == ["n2", "true"] and "BatchMode=yes" in ssh
