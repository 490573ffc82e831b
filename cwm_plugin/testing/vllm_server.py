"""A real ``vllm serve`` process on 127.0.0.1 for tests and benchmarks.

Starts on a free port with the given extra arguments, waits until ``/v1/models`` answers, keeps
its log, reads ``/metrics``, stops it by its own process group and can restart it with the same
arguments (so a store on disk or in Redis outlives it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cwm_plugin.testing.procs import (
    answers,
    free_port,
    stop_process_group,
    tail,
    terminate_leader,
    wait_until,
)

log = logging.getLogger(__name__)


def vllm_executable() -> str:
    beside = Path(sys.executable).parent / "vllm"
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm")
    if found is None:
        raise RuntimeError("the `vllm` command is not installed; run scripts/setup.sh")
    return found


@dataclass
class VLLMServer:
    """One ``vllm serve`` process. ``extra_args`` go after the model directory."""

    model_dir: str | os.PathLike[str]
    served_name: str = "tiny"
    dtype: str = "float32"
    max_model_len: int = 2048
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    kv_cache_gib: int = 1
    enforce_eager: bool = True
    log_dir: Path | None = None
    startup_timeout: float = 400.0
    port: int = 0
    _proc: subprocess.Popen | None = field(default=None, init=False)
    _starts: int = field(default=0, init=False)
    _launched: float = field(default=0.0, init=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The ``vllm serve`` process's id while it runs (its engine core is a child)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"vllm-{self.port}-{self._starts}.log"

    def command(self) -> list[str]:
        cmd = [
            vllm_executable(), "serve", str(self.model_dir),
            "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
            "--enable-prefix-caching", "--disable-uvicorn-access-log",
        ]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        return cmd + [str(a) for a in self.extra_args]

    def start(self) -> VLLMServer:
        """Launch and wait until it answers."""
        return self.launch().wait_ready()

    def launch(self) -> VLLMServer:
        """Start the process and return at once (:meth:`wait_ready` waits for it)."""
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="cwm-vllm-"))
        self.port = self.port or free_port()
        self._starts += 1
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        cmd = self.command()
        log.info("starting vllm: %s (log %s)", " ".join(cmd), self.log_path)
        self._launched = time.monotonic()
        with open(self.log_path, "ab") as out:  # the child keeps its own descriptor
            self._proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        return self

    def wait_ready(self) -> VLLMServer:
        """Wait until ``/v1/models`` answers (stopping it if it never does)."""
        try:
            wait_until(self._ready, timeout=self.startup_timeout, interval=1.0, alive=self.alive,
                       what=f"vllm serve on port {self.port}", log_tail=lambda: tail(self.log_path))
        except BaseException:
            self.stop()  # a server that never became ready must not outlive the caller
            raise
        log.info("vllm ready on %s after %.1fs", self.base_url,
                 time.monotonic() - self._launched)
        return self

    def _ready(self) -> bool:
        return answers(f"{self.base_url}/v1/models", timeout=2.0)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a minute. With ``--shutdown-timeout`` > 0 (see
        :func:`cwm_connector_args`) vLLM shuts its workers down in order, and the KV connector
        finishes its pending saves, which restore tests rely on; with vLLM's default of 0 the
        workers are killed at once."""
        if self._proc is not None:
            stop_process_group(self._proc, grace=60.0)
            self._proc = None

    def stop_soon(self) -> subprocess.Popen | None:
        """SIGTERM and return at once: the process, for :func:`wait_process_group` to wait for
        later. vLLM's graceful exit spends seconds in interpreter teardown after its work is
        done (plain vLLM as well); a caller that needs nothing more from the server (a test's
        teardown) need not wait for it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            terminate_leader(proc)
        return proc

    def restart(self) -> VLLMServer:
        """Stop and start again on the same port with the same arguments."""
        self.stop()
        return self.start()

    def log_text(self) -> str:
        return tail(self.log_path, n=400)

    # --- client helpers -------------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        r = httpx.post(f"{self.base_url}{path}", json=body, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"POST {path} -> {r.status_code}: {r.text[:500]}")
        return r.json()

    def complete(self, prompt: str | list[int], max_tokens: int = 16, **kw: Any) -> dict[str, Any]:
        body = {"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, **kw}
        return self.post("/v1/completions", body)

    def chat(self, messages: list[dict[str, str]], max_tokens: int = 16, **kw: Any) -> dict[str, Any]:
        body = {"model": self.served_name, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0.0, **kw}
        return self.post("/v1/chat/completions", body)

    def tokenize(self, prompt: str) -> list[int]:
        return self.post("/tokenize", {"model": self.served_name, "prompt": prompt})["tokens"]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample name: value summed over labels}."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base_url}/metrics", timeout=10.0).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
        return out

    def metric(self, name: str) -> float:
        m = self.metrics()
        return m.get(name, m.get(name + "_total", 0.0))

    def metric_where(self, name: str, **labels: str) -> float:
        """``name`` (or ``name_total``) summed over the samples carrying all of ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base_url}/metrics", timeout=10.0).text
        return sum(float(s.value) for fam in text_string_to_metric_families(text)
                   for s in fam.samples if s.name in (name, name + "_total")
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    def reset_prefix_cache(self, *, external: bool = False) -> None:
        """Drop vLLM's own prefix cache (needs ``VLLM_SERVER_DEV_MODE=1`` in ``env``);
        ``external``: the KV connector's cache too (ours: the workers' memory tiers and the
        scheduler's beliefs, so the next load comes from a durable tier)."""
        params = {"reset_external": "true"} if external else None
        httpx.post(f"{self.base_url}/reset_prefix_cache", params=params,
                   timeout=60).raise_for_status()

    def __enter__(self) -> VLLMServer:
        # (``with server.start():`` must not launch a second process the exit would not stop)
        return self if self._proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kv_transfer_config(connector: str, module: str | None, extra: dict[str, Any] | None = None,
                       *, recompute_on_load_failure: bool = True) -> str:
    """The JSON for ``--kv-transfer-config``."""
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both",
                           "kv_connector_extra_config": extra or {}}
    if module:
        cfg["kv_connector_module_path"] = module
    if recompute_on_load_failure:
        cfg["kv_load_failure_policy"] = "recompute"
    return json.dumps(cfg)


SHUTDOWN_TIMEOUT_S = 30  # vLLM's default, 0, SIGKILLs the workers with saves still in flight


def cwm_connector_args(store: dict[str, Any], **connector: Any) -> list[str]:
    """``vllm serve`` arguments that load our connector with the given store settings, and give
    it time on SIGTERM to finish its saves (``--shutdown-timeout``)."""
    extra = {"store": store, **connector}
    return ["--kv-transfer-config", kv_transfer_config("CWMConnector", "cwm_plugin.connector", extra),
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]


def start_all(*servers: VLLMServer) -> tuple[VLLMServer, ...]:
    """Start ``servers`` side by side and wait for each: a server's start is mostly three
    single-threaded processes importing vLLM one after the other, so even on 2 cores two
    starts overlap almost wholly. Any that fails stops them all."""
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers
