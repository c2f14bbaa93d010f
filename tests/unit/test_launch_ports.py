"""coordinator.launch.free_port: a process's gRPC and /metrics ports must differ. The kernel may hand a
just-closed port out again (CI once gave a coordinator 58801 for both and it died at start-up)."""
from __future__ import annotations

import socket

from coordinator import launch


class _ScriptedSocket:
    """Stands in for socket.socket: bind() succeeds, getsockname() answers the next scripted port."""

    def __init__(self, ports):
        self._ports = ports

    def __call__(self, *args, **kwargs):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, address):
        assert address == ("127.0.0.1", 0)

    def getsockname(self):
        return ("127.0.0.1", self._ports.pop(0))


def test_a_port_the_kernel_repeats_is_not_handed_out_twice(monkeypatch):
    monkeypatch.setattr(launch, "_HANDED_OUT", launch.collections.deque(maxlen=256))
    scripted = _ScriptedSocket([40001, 40001, 40001, 40002, 40001, 40003])
    monkeypatch.setattr(launch.socket, "socket", scripted)
    assert [launch.free_port(), launch.free_port(), launch.free_port()] == [40001, 40002, 40003]
    assert scripted._ports == []  # each repeat was asked again, nothing skipped


def test_real_ports_are_distinct_and_bindable():
    ports = [launch.free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free now: nothing listens on it
