"""A real ``redis-server`` on a free loopback port, without persistence, for tests and benches."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cwm_plugin.testing.procs import free_port, tail, terminate, wait_until


@dataclass
class RedisServer:
    """Start with :meth:`start`, stop with :meth:`stop` (or use as a context manager)."""

    port: int = 0
    workdir: Path | None = None
    binary: str = "redis-server"
    extra_args: tuple[str, ...] = ()
    _own_dir: bool = field(default=False, init=False)
    _proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        exe = shutil.which(self.binary)
        if exe is None:
            raise RuntimeError(
                "redis-server is not installed; run scripts/setup.sh (it installs the Debian package)"
            )
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="cwm-redis-"))
            self._own_dir = True
        self.port = self.port or free_port()
        log = self.workdir / "redis.log"
        with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
            self._proc = subprocess.Popen(
                [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                 "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "yes",
                 *self.extra_args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        try:
            wait_until(self.ping, timeout=timeout, interval=0.05, alive=self.alive,
                       what=f"redis-server on port {self.port}", log_tail=lambda: tail(log))
        except BaseException:
            self.stop()  # never leave a half-started server behind
            raise
        return self

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ping(self) -> bool:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc)
        self._proc = None
        if self._own_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
