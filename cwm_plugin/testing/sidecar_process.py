"""``cwm serve`` in its own process, as a deployment runs it, for tests, benchmarks and the demo.

Starts on a free loopback port with the server secret in its environment (never on the command
line), waits until ``/health`` answers, keeps its log, and stops it by its process group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cwm_plugin.testing.procs import (
    answers,
    free_port,
    kill_group,
    stop_process_group,
    tail,
    wait_until,
)


@dataclass
class SidecarProcess:
    config: Path
    upstream: str | None            # None: the config's ``upstreams:`` list
    log_dir: Path
    secret: str
    port: int = 0
    log_level: str = "warning"
    startup_timeout: float = 180.0
    _proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"sidecar-{self.port}.log"

    def start(self) -> SidecarProcess:
        self.port = self.port or free_port()
        cmd = [sys.executable, "-m", "cwm_plugin.cli", "serve", "--config", str(self.config),
               *(["--upstream", self.upstream] if self.upstream else []),
               "--port", str(self.port), "--log-level", self.log_level]
        env = {**os.environ, "CWM_SIDECAR_SECRET": self.secret, "HF_HUB_OFFLINE": "1"}
        with open(self.log_path, "ab") as out:  # the child keeps its own descriptor
            self._proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_until(self._ready, timeout=self.startup_timeout, interval=0.5,
                       alive=lambda: self._proc is not None and self._proc.poll() is None,
                       what="cwm serve", log_tail=lambda: tail(self.log_path))
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        return answers(f"{self.url}/health", timeout=2.0)

    def kill(self) -> None:
        """SIGKILL the process group (a replica that dies: nothing it holds is finished)."""
        if self._proc is not None:
            kill_group(self._proc)
            self._proc = None

    def stop(self) -> None:
        if self._proc is not None:
            stop_process_group(self._proc)
            self._proc = None

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
