"""bench/serving.py's faults under load: each a round of the workload (``--fault-rounds`` more
rounds of every user) with a fault injected a third of the way in, reported as failed requests
and ITL p99 against a fault-free round of the same shape.

On a second ``cwm_redis`` server (same disk folder; its Redis reached through
cwm_plugin/testing/tcp_proxy.py in a process of its own), continuing the main phase's users:
* ``none``            the fault-free baseline round;
* ``redis_restart``   redis-server stopped and started again on its port (empty: no
  persistence) after ``--redis-down-s`` seconds;
* ``redis_blackhole`` the proxy holds every byte both ways for ``--blackhole-s`` (10) seconds:
  a Redis that accepts connections and never answers;
* ``store_gc``        ``cwm store gc --config --every`` (disk + Redis, the shipped minimum
  age) as the README runs it beside vLLM: one process under ``chrt --idle 0``, a pass every
  ``--gc-every-s`` seconds (start to start), started at the fault and stopped when the round
  ends; far more often than a real schedule. (One process for every pass, not one a pass as
  cron would start them: most of such a pass's CPU is Python's start and imports.)

On servers of their own:
* ``tiny_budgets``    the same users on a fresh server whose memory tier holds 2 blocks, disk
  tier 4 blocks, Redis ``maxmemory`` a few blocks (``volatile-lru``; the shipped TTL makes
  blobs evictable): every tier evicts all the time (baseline: ``none``);
* ``sidecar_kill``    two vLLMs sharing the Redis, ``cwm serve`` in front routing each session
  (``X-Session-Id``; the sidecar salts them) to its own of the two (``routing.affinity:
  session``, as shipped: about half on each); the first is SIGKILLed mid-round and the
  sidecar fails its sessions over to the second, which restores them from Redis (the second's
  own sessions go on where they were). Baseline: the same two servers
  and sidecar, a fault-free round just before (after one unreported warm-up round: the
  sidecar's salts are not the bench's, so every session starts cold there).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml
from _serving_configs import SERVED, connector_args, shipped_redis
from _serving_workload import Request, Runner, Session

from cwm_plugin.testing.redis_server import RedisServer
from cwm_plugin.testing.vllm_server import VLLMServer, start_all

log = logging.getLogger("bench.serving")
Action = Callable[[threading.Event], None]


async def round_with(runner: Runner, sessions: Sequence[Session], rounds: int, phase: str,
                     action: Action | None = None, at_s: float = 0.0) -> list[Request]:
    """``rounds`` rounds of ``sessions``; ``action(done)`` starts ``at_s`` seconds in, in a
    thread (``done`` is set when the round's requests are all answered)."""
    done = threading.Event()

    async def inject() -> None:
        await asyncio.sleep(at_s)
        log.info("%s: injecting the fault %.1fs into the round", phase, at_s)
        await asyncio.to_thread(action, done)
        log.info("%s: fault over", phase)

    task = asyncio.create_task(inject()) if action else None
    try:
        return await runner.run(sessions, rounds, phase)
    finally:
        done.set()
        if task is not None:
            await task


@dataclass
class RedisHolder:
    """The bench's redis-server, restartable on the same port (the proxy keeps pointing there)."""

    server: RedisServer
    restarts: int = 0
    workdirs: list[Path] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return self.server.url

    def restart(self, down_s: float) -> None:
        port = self.server.port
        self.server.stop()
        time.sleep(down_s)
        self.server = RedisServer(port=port).start()
        self.restarts += 1

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stop(self) -> None:
        self.server.stop()


def restart_redis(holder: RedisHolder, down_s: float) -> Action:
    return lambda done: holder.restart(down_s)


class ProxyProcess:
    """``cwm_plugin.testing.tcp_proxy`` in a process of its own in front of the bench's Redis
    (in the bench's process its threads would share the GIL with the client it measures),
    driven over its stdin; the Redis can restart behind it on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> ProxyProcess:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "cwm_plugin.testing.tcp_proxy", "--target",
             f"127.0.0.1:{self.target_port}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1)
        self.port = int(self._proc.stdout.readline())
        return self

    def command(self, cmd: str) -> None:
        assert self._proc is not None
        self._proc.stdin.write(cmd + "\n")
        self._proc.stdin.flush()
        if (reply := self._proc.stdout.readline().strip()) != "ok":
            raise RuntimeError(f"tcp proxy: {cmd}: {reply!r}")

    def black_hole(self, on: bool) -> None:
        self.command("blackhole" if on else "resume")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.stdin.write("quit\n")
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def black_hole(proxy: ProxyProcess, seconds: float) -> Action:
    def act(done: threading.Event) -> None:
        proxy.black_hole(True)
        try:
            time.sleep(seconds)
        finally:
            proxy.black_hole(False)
    return act


def store_gc(config: Path, work: Path, runs: list[dict[str, Any]], every_s: float) -> Action:
    """``cwm store gc --config --every every_s`` until the round is done, then SIGTERM; each
    pass's seconds go into ``runs``, then the exit code (``{"exit": rc}``)."""
    exe = Path(sys.executable).parent / "cwm"
    cmd = [str(exe) if exe.exists() else "cwm", "store", "gc", "--config", str(config), "--json",
           "--every", str(max(every_s, 0.05))]
    if shutil.which("chrt"):    # idle from exec on (the command lowers itself after its imports)
        cmd = ["chrt", "--idle", "0", *cmd]
    log_path = work / "store-gc.log"

    def act(done: threading.Event) -> None:
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
            try:
                done.wait()
            finally:
                proc.terminate()
                try:
                    rc = proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
        runs.extend({"seconds": json.loads(line)["seconds"]}
                    for line in log_path.read_text().splitlines() if line.startswith("{"))
        runs.append({"exit": rc})
    return act


def store_yaml(path: Path, store: dict[str, Any]) -> Path:
    """The store's settings as ``cwm store`` reads them."""
    keep = {k: v for k, v in store.items() if v is not None}
    path.write_text(yaml.safe_dump({"store": keep}))
    return path


def kill_server(server: VLLMServer) -> Action:
    """SIGKILL the whole ``vllm serve`` process group (a crash: no flush), then reap it."""
    def act(done: threading.Event) -> None:
        if server.pid is not None:
            os.killpg(server.pid, signal.SIGKILL)
        server.stop()
    return act


def squeeze_redis(holder: RedisHolder, maxmemory: int) -> Callable[[], Callable[[], None]]:
    """Set Redis's ``maxmemory`` (volatile-lru) now; the returned call sets it back."""
    def apply() -> Callable[[], None]:
        c = holder.client()
        old = c.config_get("maxmemory*")
        c.config_set("maxmemory-policy", "volatile-lru")
        c.config_set("maxmemory", maxmemory)
        log.info("redis squeezed to %d bytes (was %s)", maxmemory, old)

        def undo() -> None:
            c.config_set("maxmemory", old.get("maxmemory", "0"))
            c.config_set("maxmemory-policy", old.get("maxmemory-policy", "noeviction"))
            c.close()
        return undo
    return apply


def sidecar_yaml(path: Path, model: Path, urls: dict[str, str], key_sha256: str,
                 served: str, balancer: bool = False) -> Path:
    """The bench's sidecar: one tenant, memory off, ``urls`` its upstreams (``balancer``:
    each a vllm-router, bench/routing.py)."""
    path.write_text(yaml.safe_dump({
        "tenants": [{"name": "bench", "key_sha256": [key_sha256]}],
        # one tenant stands for every user of the workload: no per-tenant limit in the way
        "rate_limits": {"rate_limit": "none", "token_quota": "none"},
        "memory_enabled": False,
        "memory": {"root": str(path.parent / "sidecar-memory"), "tokenizer": str(model)},
        "upstream": {"connect_timeout_s": 2, "connect_retries": 1, "read_timeout_s": 600},
        "upstreams": [{"name": n, "url": u, "models": [served], "roles": ["default"],
                       "balancer": balancer} for n, u in urls.items()],
        "routing": {"health": {"interval_s": 2, "timeout_s": 2}},
        "access": {"grants": {"bench": ["metrics"]}}}))  # (the bench reads /metrics)
    return path


class Player(Protocol):
    """What the fault rounds need of the bench (:class:`serving.Bench`): its phases, its
    servers, the workload and the run's arguments and results."""

    servers: Any
    spec: Any
    args: Any
    out: dict[str, Any]

    def sessions(self, tag: str, users: int | None = None) -> list[Session]: ...

    def play(self, url: str, sessions: list[Session], rounds: int, phase: str,
             **kw: Any) -> list[Request]: ...

    def warm(self, url: str, tag: str) -> None: ...

    def phase(self, server: Any, sessions: list[Session], rounds: int, phase: str,
              url: str | None = None, **kw: Any) -> dict[str, Any]: ...


class FaultRounds:
    """The fault rounds and the sidecar's failover (see the module docstring), played by the
    bench's phases; results go into ``bench.out``."""

    def __init__(self, bench: Player) -> None:
        self.bench = bench
        self.base: dict[str, Any] = {}  # the fault-free round the tiny budgets compare with

    def fault(self, name: str, server: Any, sessions: list[Session], base: dict[str, Any],
              action: Action | None, **kw: Any) -> dict[str, Any]:
        args = self.bench.args
        at = args.fault_at * (base.get("duration_s") or 10.0)
        got = self.bench.phase(server, sessions, args.fault_rounds, f"fault-{name}",
                               action=action, at_s=at, **kw)
        got.update(baseline_itl_p99_s=base.get("itl_p99_s"), injected_at_s=at)
        self.bench.out["fault_rounds"][name] = got
        return got

    def redis_faults(self, sessions: list[Session], redis: RedisHolder, proxy: Any) -> None:
        """The Redis faults on a ``cwm_redis`` server of their own whose Redis is behind the
        proxy (the main row's server reaches Redis straight, so that no proxy process is in
        the path of its scheduler's lookups); same disk folder, same sessions."""
        with self.bench.servers.serve("cwm_redis", redis_url=proxy.url) as server:
            self.bench.warm(server.base_url, "faults")
            self._redis_faults(server, sessions, redis, proxy)

    def _redis_faults(self, server: Any, sessions: list[Session], redis: RedisHolder,
                      proxy: Any) -> None:
        bench, args, work = self.bench, self.bench.args, self.bench.servers.work
        base = bench.phase(server, sessions, args.fault_rounds, "fault-none")
        bench.out["fault_rounds"]["none"] = self.base = {**base,
                                                         "baseline_itl_p99_s": base["itl_p99_s"]}
        self.fault("redis_restart", server, sessions, base,
                   restart_redis(redis, args.redis_down_s))
        self.fault("redis_blackhole", server, sessions, base,
                   black_hole(proxy, args.blackhole_s))
        store = shipped_redis(redis.url, work / "redis-disk")["store"]
        runs: list[dict[str, Any]] = []
        cfg = store_yaml(work / "gc-store.yaml", store)
        self.fault("store_gc", server, sessions, base,
                   store_gc(cfg, work, runs, args.gc_every_s))
        bench.out["fault_rounds"]["store_gc"].update(gc_runs=runs, gc_every_s=args.gc_every_s)

    def tiny_budgets(self, sessions: list[Session], redis: RedisHolder) -> None:
        servers = self.bench.servers
        block = servers.sizes.kv_bytes_per_token * 128
        extra = shipped_redis(redis.url, servers.work / "tiny-disk",
                              memory_bytes=2 * block, disk_bytes=4 * block)
        undo = squeeze_redis(redis, 8 * block + (4 << 20))()
        try:
            with servers.vllm(connector_args(extra)) as server:
                self.bench.warm(server.base_url, "tiny")
                self.fault("tiny_budgets", server, sessions, self.base, None)
        finally:
            undo()

    def sidecar(self, redis: RedisHolder) -> None:
        from cwm_plugin.sidecar.identity.authenticator import hash_key
        from cwm_plugin.testing.sidecar_process import SidecarProcess

        bench, servers = self.bench, self.bench.servers
        work = servers.work
        url = f"redis://127.0.0.1:{redis.port}/0"
        a, b = (servers.vllm(connector_args(shipped_redis(url, work / f"sc-{n}")))
                for n in "ab")
        key = secrets.token_hex(16)
        try:
            start_all(a, b)
            cfg = sidecar_yaml(work / "sidecar.yaml", servers.model,
                               {"a": a.base_url, "b": b.base_url}, hash_key(key), SERVED)
            with SidecarProcess(cfg, None, work, secrets.token_hex(32)) as sc:
                sessions = bench.sessions("sidecar")
                kw = {"salted": False, "api_key": key}
                bench.play(sc.url, sessions, 1, "sidecar-warm", **kw)
                base = bench.phase(a, sessions, bench.args.fault_rounds, "sidecar-none",
                                   **kw, url=sc.url)
                bench.out["sidecar_baseline"] = base
                self.fault("sidecar_kill", b, sessions, base, kill_server(a), **kw,
                           url=sc.url)
        finally:
            a.stop()
            b.stop()
