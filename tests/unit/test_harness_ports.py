"""The test and bench harness's free ports (stream_app/devtools/harness.py): ports asked for together are
distinct, and a port handed out before (a worker's that may not listen yet) is never handed out again."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from stream_app.devtools import harness


def test_ports_asked_for_together_are_distinct_and_free() -> None:
    ports = harness.free_ports(20)
    assert len(set(ports)) == 20
    for port in ports:  # each can be bound now
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_to_avoid_is_never_handed_out_even_when_the_system_offers_it_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The system offers 41000 (handed out a moment ago, its worker not listening yet) before 41001."""
    offered = iter([41000, 41000, 41001, 41002])

    class _Socket:
        def bind(self, address: Any) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

        def close(self) -> None:
            pass

    monkeypatch.setattr(harness.socket, "socket", _Socket)
    assert harness.free_port(avoid={41000}) == 41001
    assert harness.free_ports(1, avoid=()) == [41002]
