"""The HTTP server's bounds, over real sockets: a header over ``max_header_bytes`` is refused,
headers that never end and a body sent a byte at a time are cut off, connections past
``max_connections`` get a 503, window imports are bounded in size (by default too), in how
many of a tenant's run at once (never by other tenants' imports) and in time (a slow-loris upload
is cut by the default body pace and by ``windows.import_timeout_s``). The in-process server (``ServerThread``) and
``cwm serve`` (``SidecarProcess``) apply the same ``server:`` settings."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sidecar_helpers import KEYS, SECRET, make_settings

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.testing.sidecar_process import SidecarProcess

pytestmark = pytest.mark.unit
CHAT = "/v1/chat/completions"
IMPORT = "/v1/windows/import"


@contextmanager
def sidecar(tmp_path: Path, **over: Any) -> Iterator[ServerThread]:
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up, ServerThread(create_app(make_settings(
            up.url, tmp_path / "memory", "tiktoken:cl100k_base",
            routing={"health": {"interval_s": 0}}, **over))) as srv:
        yield srv


def head(method: str, path: str, tenant: str = "acme", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x", f"Authorization: Bearer {KEYS[tenant]}",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(s: socket.socket) -> bytes:
    """What the server sends until it closes the connection (b"" if it closes at once);
    raises ``TimeoutError`` if it does neither within the socket's timeout."""
    out = b""
    try:
        while data := s.recv(65536):
            out += data
    except ConnectionResetError:
        pass
    return out


def test_a_header_over_the_bound_is_refused(tmp_path):
    with sidecar(tmp_path) as srv, socket.create_connection((srv.host, srv.port), 15) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused early
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"a" * (1 << 20) +
                      b"\r\n\r\n")
        got = answer(s)
        assert got == b"" or got.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), got[:100]
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def test_headers_that_never_end_are_cut_off(tmp_path):
    with sidecar(tmp_path, server={"header_timeout_s": 1.0}) as srv:
        with socket.create_connection((srv.host, srv.port), 15) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # ... and nothing more
            assert answer(s) == b""  # closed, long before the socket's 15 s
        with socket.create_connection((srv.host, srv.port), 15) as s:
            assert answer(s) == b""  # a connection that never sends a byte
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def trickle(srv: ServerThread, request: bytes, piece: bytes, every_s: float) -> bytes:
    """``request``'s head, then ``piece`` after ``piece`` every ``every_s``: what the server
    answers once it gives up on the body (within a minute)."""
    with socket.create_connection((srv.host, srv.port), 30) as s:
        s.sendall(request)
        s.settimeout(every_s)
        got = b""
        for _ in range(int(60 / every_s)):
            try:
                s.sendall(piece)
                got = s.recv(65536)
                break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        s.settimeout(15)
        return got + answer(s)


def test_a_body_a_byte_at_a_time_is_cut_off_with_408(tmp_path):
    with sidecar(tmp_path, server={"body_timeout_s": 1.0, "body_min_rate": 500}) as srv:
        # a byte every 0.5 s: 100 s to send what it declared
        got = trickle(srv, head("POST", CHAT, Content_Type="application/json",
                                Content_Length="200"), b" ", 0.5)
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert b'"request_timeout"' in got
        # a client at a sane rate is served
        r = httpx.post(f"{srv.url}{CHAT}", timeout=30, headers={
            "Authorization": f"Bearer {KEYS['acme']}"}, json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200


def test_connections_past_the_bound_get_503(tmp_path):
    with sidecar(tmp_path, server={"max_connections": 4}) as srv:
        idle = [socket.create_connection((srv.host, srv.port), 15) for _ in range(4)]
        try:
            assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 503
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 15
        while httpx.get(f"{srv.url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "closed connections were never let go"
            time.sleep(0.1)


def importing(srv: ServerThread, tenant: str) -> int:
    """A whole (and worthless) window file: its status (400 when it was read and refused)."""
    return httpx.post(f"{srv.url}{IMPORT}", content=b"junk" * 64, timeout=30,
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"}).status_code


@contextmanager
def stalled_import(srv: ServerThread, tenant: str) -> Iterator[None]:
    """An import whose body stops coming: it holds its slot while it lasts."""
    with socket.create_connection((srv.host, srv.port), 30) as s:
        s.sendall(head("POST", IMPORT, tenant, Content_Length="100000") + b"CWMW")
        yield


def until(check: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_window_imports_are_bounded_in_size_and_per_tenant_only(tmp_path):
    with sidecar(tmp_path, windows={"store": {"disk_path": str(tmp_path / "kv")}}) as srv:
        # by default an import is at most 1 GiB: a larger one is refused before its body
        with socket.create_connection((srv.host, srv.port), 15) as s:
            s.sendall(head("POST", IMPORT, Content_Length=str(2 << 30)))
            assert s.recv(65536).startswith(b"HTTP/1.1 413")
        assert importing(srv, "acme") == 400  # read whole, and refused: nothing held
        with stalled_import(srv, "acme"):
            until(lambda: importing(srv, "acme") == 429, "a tenant's imports were unbounded")
            assert importing(srv, "beta") == 400  # another tenant's import runs
            with stalled_import(srv, "beta"):  # two tenants' imports never refuse a third's
                assert importing(srv, "gamma") == 400
        until(lambda: importing(srv, "acme") == 400, "a closed import kept its slot")


def test_a_slow_loris_import_is_cut_off_by_the_default_body_pace(tmp_path):
    # 2 KiB a second would keep a 1 GiB body coming for almost a week
    with sidecar(tmp_path, windows={"store": {"disk_path": str(tmp_path / "kv")}},
                 server={"body_timeout_s": 1.0}) as srv:
        got = trickle(srv, head("POST", IMPORT, Content_Length=str(64 << 20)), b"x" * 512,
                      0.25)
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert b'"request_timeout"' in got
        assert importing(srv, "acme") == 400  # its slot is free again


def test_an_import_slower_than_its_timeout_is_cut_off(tmp_path):
    # a pace the server itself would wait for, but the whole upload has its own deadline
    with sidecar(tmp_path, windows={"store": {"disk_path": str(tmp_path / "kv")},
                                    "import_timeout_s": 1.0},
                 server={"body_min_rate": 1}) as srv:
        got = trickle(srv, head("POST", IMPORT, Content_Length=str(64 << 20)), b"x" * 64, 0.25)
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert b"import_timeout_s" in got


def test_cwm_serve_applies_the_server_bounds(tmp_path):
    fake = FakeUpstream(model="tiny")
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump({
        "tenants": [{"name": "acme", "key_sha256": [hash_key(KEYS["acme"])]}],
        "memory": {"root": str(tmp_path / "memory"), "tokenizer": "tiktoken:cl100k_base",
                   "embedder": {"kind": "hashing"}, "warm_on_start": False},
        "routing": {"health": {"interval_s": 0}},
        "server": {"header_timeout_s": 1.0, "max_header_bytes": 4096}}))
    with ServerThread(fake.app) as up, SidecarProcess(config, up.url, tmp_path, SECRET) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), 15) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            assert answer(s) == b""
        with socket.create_connection(("127.0.0.1", srv.port), 15) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"a" * 8192 +
                      b"\r\n\r\n")
            assert answer(s).startswith(b"HTTP/1.1 431")
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
