"""The fake-node harness itself (megatron_recover.testing.nodes), without a job: a node loss
leaves the other nodes able to reach this machine at once, as a cluster's head node stays
reachable when a peer dies. Seconds; needs root (skipped with the reason otherwise)."""

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megatron_recover.testing.nodes import FakeNodes, unavailable_reason

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=unavailable_reason() or "")]
CONNECT_S = 5.0  # a lost ARP entry was seen to hold a connection 68 s, or time it out


def _mac(device: str) -> str:
    return Path(f"/sys/class/net/{device}/address").read_text().strip()


def _connect_from(nodes: FakeNodes, name: str, port: int) -> subprocess.CompletedProcess:
    probe = (f"import socket; socket.create_connection(('{nodes.machine_address}', {port}), "
             f"timeout={CONNECT_S}).close()")
    return subprocess.run(["nsenter", "-t", str(nodes.holders[name].pid), "-n", sys.executable,
                           "-c", probe], capture_output=True, text=True,
                          timeout=CONNECT_S + 10)


def _serve(server: socket.socket) -> None:
    try:
        while True:
            server.accept()[0].close()
    except OSError:  # closed when the test ends
        pass


@pytest.mark.timeout(120)
def test_the_machine_stays_reachable_when_the_node_with_the_lowest_mac_is_lost():
    """Linux gives an unset bridge the lowest MAC of its ports: losing that node would change
    the machine's MAC under the survivor. The node lost here is that one."""
    with FakeNodes(["nodeB", "nodeC"]) as nodes:
        with socket.create_server((nodes.machine_address, 0)) as server:
            port = server.getsockname()[1]
            threading.Thread(target=_serve, args=(server,), daemon=True).start()
            lost, survivor = sorted(nodes.names, key=lambda n: _mac(nodes._veth(n)))
            before = _connect_from(nodes, survivor, port)
            assert before.returncode == 0, before.stderr
            mac = _mac(nodes.bridge)
            nodes.kill_node(lost)
            assert not (Path("/sys/class/net") / nodes._veth(lost)).exists()  # its port is gone
            after = _connect_from(nodes, survivor, port)
            assert after.returncode == 0, after.stderr[-300:]
            assert _mac(nodes.bridge) == mac
    assert nodes.links() == []
