"""LMCache's multi-process server (``lmcache server``) with its fs store, our peer in benchmarks.

LMCache's classic in-process connector does not run on CPU (see docs/vllm-cpu.md);
its multi-process mode does: this starts the server on a free loopback port, and
:meth:`vllm_args` gives the matching ``--kv-transfer-config`` for ``LMCacheMPConnector``.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cwm_plugin.testing.procs import free_port, stop_process_group, tail, wait_until
from cwm_plugin.testing.vllm_server import kv_transfer_config


@dataclass
class LMCacheServer:
    store_dir: Path
    log_dir: Path
    l1_gb: int = 1
    chunk_size: int = 256
    l2_fs: bool = True              # False: CPU offload only (L1), no fs store behind it
    port: int = 0
    _proc: subprocess.Popen | None = field(default=None, init=False)

    def command(self) -> list[str]:
        exe = Path(sys.executable).parent / "lmcache"
        if not exe.exists():
            found = shutil.which("lmcache")
            if found is None:
                raise RuntimeError("lmcache is not installed: CWM_WITH_LMCACHE=1 bash scripts/setup.sh")
            exe = Path(found)
        l2 = ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(self.store_dir)})]
        return [str(exe), "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--l1-size-gb", str(self.l1_gb), "--eviction-policy", "LRU",
                "--chunk-size", str(self.chunk_size), "--supported-transfer-mode", "auto",
                "--disable-observability", "--disable-metrics", *(l2 if self.l2_fs else [])]

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"lmcache-{self.port}.log"

    def _listening(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def start(self, timeout: float = 120.0) -> LMCacheServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        with open(self.log_path, "ab") as out:
            self._proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        wait_until(self._listening, timeout=timeout, alive=lambda: self._proc.poll() is None,
                   what="lmcache server", log_tail=lambda: tail(self.log_path))
        return self

    def stop(self) -> None:
        if self._proc is not None:
            stop_process_group(self._proc)
            self._proc = None

    def vllm_args(self) -> list[str]:
        extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}
        return ["--kv-transfer-config", kv_transfer_config("LMCacheMPConnector", None, extra)]

    def stored_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.store_dir.rglob("*") if f.is_file())
