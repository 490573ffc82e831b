"""A real nginx on a free loopback port balancing HTTP over backends, for tests and benches:
the load balancer a deployment puts in front of sidecar replicas (``docs/sidecar.md``).

Requests are spread by a consistent hash of ``X-Session-Id`` (a session's turns go to one
replica while it is up), and a request a replica could not take (connection refused or reset
before any response byte, a 502/503) is passed to the next one, POSTs included: a sidecar
answers a chat only when it is done, so a replica that dies mid-request has sent nothing. The
config is written to a temporary folder; nginx runs in the foreground as a child process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cwm_plugin.testing.procs import free_port, tail, terminate, wait_until

CONFIG = """
{user}
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  log_format routed '$http_x_session_id $upstream_addr';
  access_log {dir}/access.log routed;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  upstream replicas {{
    hash $http_x_session_id consistent;
{servers}
  }}
  server {{
    listen 127.0.0.1:{port};
    client_max_body_size 64m;
    location / {{
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 300s;
      proxy_connect_timeout 2s;
      proxy_next_upstream {next_upstream};
      proxy_next_upstream_tries {tries};
    }}
  }}
}}
"""


@dataclass
class NginxBalancer:
    """Start with :meth:`start`, stop with :meth:`stop` (or use as a context manager)."""

    backends: list[str]  # host:port each
    port: int = 0
    fail_timeout_s: int = 2  # a backend that failed is skipped this long
    retry: bool = True  # pass a request a backend could not take to the next one
    _dir: Path | None = field(default=None, init=False)
    _proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> NginxBalancer:
        exe = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(exe).exists():
            raise RuntimeError("nginx is not installed; run scripts/setup.sh (it installs the "
                               "Debian package nginx-light)")
        self._dir = Path(tempfile.mkdtemp(prefix="cwm-nginx-"))
        self.port = self.port or free_port()
        servers = "\n".join(f"    server {b} max_fails=1 fail_timeout={self.fail_timeout_s}s;"
                            for b in self.backends)
        conf = self._dir / "nginx.conf"
        conf.write_text(CONFIG.format(dir=self._dir, port=self.port, servers=servers,
                                      tries=len(self.backends) if self.retry else 1,
                                      next_upstream="error timeout http_502 http_503 "
                                                    "non_idempotent" if self.retry else "off",
                                      # (as root, its workers run as root too)
                                      user="user root;" if os.geteuid() == 0 else ""))
        log = self._dir / "error.log"
        self._proc = subprocess.Popen([exe, "-c", str(conf), "-p", str(self._dir)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        try:
            wait_until(self._listening, timeout=timeout, interval=0.05,
                       alive=lambda: self._proc is not None and self._proc.poll() is None,
                       what=f"nginx on port {self.port}", log_tail=lambda: tail(log))
        except BaseException:
            self.stop()
            raise
        return self

    def _listening(self) -> bool:
        try:
            httpx.get(f"{self.url}/health", timeout=1.0)
            return True
        except httpx.HTTPError:
            return False

    def backend_of(self, session: str) -> str:
        """The backend (``host:port``) the balancer sends ``session``'s requests to while
        every backend is up: one ``/health`` request with its ``X-Session-Id``, read back
        from the access log (one line a request, written when the request ends)."""
        assert self._dir is not None, "start the balancer first"
        httpx.get(f"{self.url}/health", headers={"X-Session-Id": session}, timeout=5.0)
        for line in reversed((self._dir / "access.log").read_text().splitlines()):
            name, _, addr = line.rpartition(" ")
            if name == session:
                return addr
        raise RuntimeError(f"nginx logged no request of session {session!r}")

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc)  # nginx: a fast shutdown
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> NginxBalancer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
