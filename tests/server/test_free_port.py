"""`free_port`: a port below the kernel's ephemeral range with free ports above it for a data-parallel server's
replicas; under pytest-xdist, two workers never get ports of one block."""

import socket

import pytest

from tests.server import server_process
from tests.server.server_process import PORT_BLOCK, REPLICA_ROOM, free_port, port_blocks

pytestmark = pytest.mark.skipif(not port_blocks(), reason="no /proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.parametrize("worker", [0, 1, 2])
def test_each_worker_takes_ports_from_its_own_blocks_below_the_ephemeral_range(monkeypatch, worker):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    ports = [free_port() for _ in range(40)]
    for port in ports:
        block, offset = divmod(port, PORT_BLOCK)
        assert block % 3 == worker and offset + REPLICA_ROOM <= PORT_BLOCK and block in port_blocks()
    assert all(abs(a - b) >= REPLICA_ROOM for i, a in enumerate(ports) for b in ports[:i])  # (none handed out twice)


def test_ports_in_use_are_not_handed_out_nor_below_them_within_the_replicas_room(monkeypatch):
    """gw0's share is one block; a listener on its port REPLICA_ROOM leaves one port whose room is free, the first;
    a listener there too leaves none."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(len(port_blocks())))  # a share of one block
    monkeypatch.setattr(server_process, "_handed_out", server_process.collections.deque(maxlen=0))
    (block,) = [block for block in port_blocks() if block % len(port_blocks()) == 0]
    first = block * PORT_BLOCK
    with socket.socket() as above, socket.socket() as first_held:
        above.bind(("127.0.0.1", first + REPLICA_ROOM))
        assert {free_port() for _ in range(20)} == {first}
        first_held.bind(("127.0.0.1", first))
        with pytest.raises(RuntimeError, match=f"no {REPLICA_ROOM} free ports together"):
            free_port()
