"""The TCP proxy the fault tests put in front of Redis: forwards, black-holes, resumes."""

from __future__ import annotations

import socket
import threading

import pytest

from cwm_plugin.testing.tcp_proxy import TcpProxy

pytestmark = pytest.mark.unit


@pytest.fixture
def echo():
    """An echo server on a free port (what is sent comes back)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield server.getsockname()[1]
    stop.set()
    t.join()
    server.close()


def ask(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        got += sock.recv(4096)
    return got


def test_forwards_blackholes_and_resumes_with_nothing_lost(echo):
    with TcpProxy(echo) as proxy:
        old = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
        assert ask(old, b"hello" * 1000) == b"hello" * 1000
        proxy.blackhole()
        assert proxy.blackholed
        old.settimeout(0.3)
        old.sendall(b"held")
        with pytest.raises(TimeoutError):               # no answer, no reset
            old.recv(10)
        new = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)  # accepted
        new.settimeout(0.3)
        new.sendall(b"also held")
        with pytest.raises(TimeoutError):
            new.recv(10)
        proxy.resume()
        old.settimeout(2)
        new.settimeout(2)
        assert old.recv(4) == b"held"                    # held bytes go through
        assert new.recv(9) == b"also held"
        assert ask(new, b"again") == b"again"
        assert proxy.connections == 2
        old.close()
        new.close()
