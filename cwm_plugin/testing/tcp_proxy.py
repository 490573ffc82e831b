"""A TCP proxy that tests and benchmarks put in front of a Redis (or any TCP server) and can
make unresponsive on demand.

``blackhole()``: connections are still accepted and their bytes read, but nothing is forwarded
and nothing answered, in either direction (a hung server or a dead network path: clients see
timeouts, never a refused or reset connection). ``resume()``: bytes held meanwhile are
delivered, then traffic flows again. A connection either side closes is closed on the other.

In a test::

    with TcpProxy(redis.port) as proxy:
        store = {"redis_url": proxy.url}
        ...
        proxy.blackhole(); ...; proxy.resume()

From a shell (a benchmark in another process): ``python -m cwm_plugin.testing.tcp_proxy
--target 127.0.0.1:6379`` prints the port it listens on, then takes ``blackhole``, ``resume``
and ``quit`` lines on stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import selectors
import socket
import sys
import threading

POLL_S = 0.02       # how soon a connection notices blackhole/resume without traffic
CHUNK = 1 << 16


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", *,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.host = host
        self.port = port
        self._holding = threading.Event()
        self._closed = threading.Event()
        self._server: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.connections = 0          # accepted so far

    @property
    def url(self) -> str:
        """A Redis URL through the proxy (database 0)."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def blackholed(self) -> bool:
        return self._holding.is_set()

    def start(self) -> TcpProxy:
        server = socket.create_server((self.host, self.port))
        self.port = server.getsockname()[1]
        server.settimeout(POLL_S * 5)
        self._server = server
        self._spawn(self._accept)
        return self

    def blackhole(self) -> None:
        """Hold every byte from now on, accept new connections without answering them."""
        self._holding.set()

    def resume(self) -> None:
        """Deliver what was held, then forward again."""
        self._holding.clear()

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.close()
        for t in list(self._threads):
            t.join(timeout=5)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="tcp-proxy")
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            self._spawn(self._pipe, client)

    def _pipe(self, client: socket.socket) -> None:
        """Shuttle bytes between ``client`` and the target (connected once traffic may
        flow: a black-holed proxy does not even reach the server)."""
        upstream: socket.socket | None = None
        up, down = bytearray(), bytearray()      # held for the server, for the client
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, "client")
        try:
            while not self._closed.is_set():
                flowing = not self._holding.is_set()
                if flowing and upstream is None:
                    upstream = socket.create_connection(self.target, timeout=5)
                    sel.register(upstream, selectors.EVENT_READ, "server")
                if flowing:
                    if up:
                        upstream.sendall(up)
                        up.clear()
                    if down:
                        client.sendall(down)
                        down.clear()
                for key, _ in sel.select(POLL_S):
                    data = key.fileobj.recv(CHUNK)
                    if not data:
                        return
                    to_server = key.data == "client"
                    if self._holding.is_set() or (to_server and upstream is None):
                        (up if to_server else down).extend(data)
                    else:
                        (upstream if to_server else client).sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            for s in (client, upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="host:port to forward to")
    ap.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on")
    args = ap.parse_args(argv)
    th, tp = args.target.rsplit(":", 1)
    lh, lp = args.listen.rsplit(":", 1)
    with TcpProxy(int(tp), th, host=lh, port=int(lp)) as proxy:
        print(proxy.port, flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "blackhole":
                proxy.blackhole()
            elif cmd == "resume":
                proxy.resume()
            elif cmd == "quit":
                break
            print("ok" if cmd in ("blackhole", "resume") else f"unknown: {cmd}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
