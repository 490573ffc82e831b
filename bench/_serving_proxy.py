"""A minimal TCP proxy for bench/serving.py's black-hole fault, until
``cwm_plugin/testing/tcp_proxy.py`` (being written beside this bench) lands and replaces it.

``TcpProxy(port).start()`` listens on a free loopback port and relays every connection to
``127.0.0.1:port`` with two threads. ``black_hole(True)`` stops relaying in both directions:
bytes already read are held (not dropped, as TCP would retransmit them after a dropped-packet
outage) and new connections are accepted but not connected upstream, so the client sees a
peer that accepts and never answers; ``black_hole(False)`` lets everything through again.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from cwm_plugin.testing.procs import free_port


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.port = 0
        self._open = threading.Event()
        self._open.set()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> TcpProxy:
        self.port = free_port()
        self._sock = socket.create_server(("127.0.0.1", self.port))
        self._sock.settimeout(0.2)
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()
        return self

    def black_hole(self, on: bool) -> None:
        if on:
            self._open.clear()
        else:
            self._open.set()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        while not self._open.is_set() and not self._stop.is_set():
            time.sleep(0.02)
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._conns += [client, upstream]
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 20):
                while not self._open.is_set() and not self._stop.is_set():
                    time.sleep(0.02)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)
                    s.close()
                    if s in self._conns:
                        self._conns.remove(s)

    def stop(self) -> None:
        self._stop.set()
        self._open.set()
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            for s in self._conns:
                with contextlib.suppress(OSError):
                    s.close()
            self._conns.clear()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
