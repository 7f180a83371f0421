"""`free_port` under pytest-xdist: two workers never get one port, nor one block (a data-parallel server's replicas
listen on the ports above its own)."""

import pytest

from tests.server.server_process import PORT_BLOCK, free_port


@pytest.mark.parametrize("worker", [0, 1, 2])
def test_each_worker_takes_ports_from_its_own_blocks_with_room_for_replicas_above(monkeypatch, worker):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    for _ in range(30):
        block, offset = divmod(free_port(), PORT_BLOCK)
        assert block % 3 == worker and offset < PORT_BLOCK // 2


def test_outside_xdist_any_free_port_will_do(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    offsets = {free_port() % PORT_BLOCK for _ in range(200)}
    assert offsets & set(range(PORT_BLOCK // 2, PORT_BLOCK))  # (the upper halves, which no worker's share holds)
