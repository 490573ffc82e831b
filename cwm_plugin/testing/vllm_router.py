"""A real ``vllm-router`` (vLLM's balancer: a Rust binary from the ``vllm-router`` wheel) on a
free loopback port, over worker URLs, for tests and benches of a deployment behind it
(``docs/router.md``).

It is started as a deployment starts it (``vllm-router --worker-urls ... --policy ...``); it
answers on its port only once every worker answered ``GET /health``, and checks them each second
here (``--worker-startup-check-interval 1``). Its log (``--log-level debug`` when asked) names
each routing decision (``KV prefix decision outcome=...``), which :meth:`VllmRouter.decisions`
reads back.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cwm_plugin.testing.procs import answers, free_port, tail, terminate, wait_until

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def executable() -> str:
    """The ``vllm-router`` command of this environment."""
    here = Path(sys.executable).with_name("vllm-router")
    exe = str(here) if here.exists() else shutil.which("vllm-router")
    if exe is None:
        raise RuntimeError("vllm-router is not installed; run scripts/setup.sh (or pip "
                           "install vllm-router)")
    return exe


@dataclass
class VllmRouter:
    """Start with :meth:`start`, stop with :meth:`stop` (or use as a context manager);
    ``args``: more of its flags (``--kv-event-source ...``); ``env``: its environment's
    additions (``VLLM_ROUTER_TOKENIZER``)."""

    workers: list[str]  # http://host:port each
    policy: str = "consistent_hash"
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    debug: bool = False
    port: int = 0
    _dir: Path | None = field(default=None, init=False)
    _proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        assert self._dir is not None, "start the router first"
        return self._dir / "router.log"

    def start(self, timeout: float = 60.0) -> VllmRouter:
        self._dir = Path(tempfile.mkdtemp(prefix="cwm-vllm-router-"))
        self.port = self.port or free_port()
        cmd = [executable(), "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *self.workers, "--policy", self.policy,
               "--worker-startup-check-interval", "1",
               # its metrics on a port of its own (the default 29000 would keep a second
               # router from starting)
               "--prometheus-port", str(free_port()), *self.args,
               *(["--log-level", "debug"] if self.debug else [])]
        with open(self.log, "wb") as out:
            self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, **self.env},
                                          start_new_session=True)
        try:
            wait_until(self._ready, timeout=timeout, interval=0.1,
                       alive=lambda: self._proc is not None and self._proc.poll() is None,
                       what=f"vllm-router on port {self.port}",
                       log_tail=lambda: ANSI.sub("", tail(self.log)))
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        return answers(f"{self.url}/health")

    def decisions(self) -> list[dict[str, str]]:
        """The ``key=value`` fields of each ``KV prefix decision`` line logged so far (with
        ``debug``): ``outcome``, ``worker``, ``credited_prefix_tokens``, ..."""
        out = []
        for line in ANSI.sub("", self.log.read_text(errors="replace")).splitlines():
            if "KV prefix decision" in line:
                out.append({k: v.strip('"') for k, v in
                            re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", line.split("decision", 1)[1])})
        return out

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc)
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> VllmRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
