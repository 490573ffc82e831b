"""A real 3-master Redis Cluster on loopback for tests: three ``redis-server --cluster-enabled
yes`` processes joined by ``redis-cli --cluster create``, stopped and removed afterwards."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cwm_plugin.testing.procs import free_port, wait_until
from cwm_plugin.testing.redis_server import RedisServer


@dataclass
class RedisCluster:
    masters: int = 3
    workdir: Path | None = None
    nodes: list[RedisServer] = field(default_factory=list)
    _own_dir: bool = False

    @property
    def url(self) -> str:
        """A seed node's URL (the cluster client discovers the others)."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 60.0) -> RedisCluster:
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli is not installed; run scripts/setup.sh")
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="cwm-redis-cluster-"))
            self._own_dir = True
        try:
            for i in range(self.masters):
                d = self.workdir / f"node{i}"
                d.mkdir(parents=True, exist_ok=True)
                node = RedisServer(port=free_port(), workdir=d, extra_args=(
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "5000", "--cluster-port", str(free_port())))
                self.nodes.append(node.start())
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas",
                            "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
            wait_until(self._ready, timeout=timeout, interval=0.2,
                       what="redis cluster state ok")
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        import redis

        for n in self.nodes:
            client = redis.Redis(port=n.port, socket_timeout=1)
            try:
                if client.cluster("info").get("cluster_state") != "ok":
                    return False
            except redis.RedisError:
                return False
            finally:
                client.close()
        return True

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        self.nodes = []
        if self._own_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
