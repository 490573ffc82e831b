"""The KV connector under a stuck or lossy store, through a real ``vllm serve`` on CPU: nothing
stalls the engine and nothing fails a request.

* vLLM's *default* ``kv_load_failure_policy`` ("fail"): a block the lookup found but the load
  cannot read (its bytes gone behind the index, as when another process evicts it between the
  lookup and the load) is recomputed, with the same output.
* A stuck store (another process holding SQLite's write lock on the disk index; a Redis behind
  a proxy that black-holes every byte) while streams decode and new sessions arrive: the gaps
  between a stream's tokens stay well below the time the store is stuck: a step that waited
  on it would leave a gap as long as the stall (or the lookup's timeout, set longer than the
  bound). The bound is half the stall, not a fixed figure: a busy 2-core machine's own gaps
  reach seconds, the stall is longer.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_connector import DEV_MODE, HITS, complete_ids, long_text

from cwm_plugin.testing.procs import hold_sqlite_write_lock
from cwm_plugin.testing.tcp_proxy import TcpProxy
from cwm_plugin.testing.vllm_server import SHUTDOWN_TIMEOUT_S, VLLMServer, kv_transfer_config

pytestmark = pytest.mark.e2e

STUCK_S = 8.0             # how long the store is stuck (at least)
MAX_GAP_S = STUCK_S / 2   # between two tokens of a stream: a step that waited out the stall is longer
STORE_TIMEOUT_S = 30.0    # the disk index's write timeout (DiskKeyIndex): a write waits that long


def start(vllm_factory, model: Path, store: dict, *extra: str, recompute: bool = False,
          **connector) -> VLLMServer:
    """A server with our connector under vLLM's default load-failure policy (``recompute``:
    the policy set explicitly, as configs/ ship it)."""
    cfg = kv_transfer_config("CWMConnector", "cwm_plugin.connector",
                             {"store": store, **connector}, recompute_on_load_failure=recompute)
    assert recompute or "kv_load_failure_policy" not in json.loads(cfg)
    return vllm_factory(model, env=DEV_MODE, extra_args=[
        "--kv-transfer-config", cfg, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        *extra]).start()


class Streams:
    """Streaming completions back to back in a thread; the gaps between tokens of each, with
    the time each gap ended."""

    def __init__(self, server: VLLMServer, max_tokens: int = 300) -> None:
        self.server = server
        self.max_tokens = max_tokens
        self.gaps: list[tuple[float, float]] = []     # (end, seconds)
        self.tokens = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Streams:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert self.error is None, f"a stream failed: {self.error!r}"

    def _run(self) -> None:
        try:
            self._streams()
        except BaseException as exc:     # the test sees it
            self.error = exc

    def _streams(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {"model": self.server.served_name, "prompt": long_text(500 + n, 40),
                    "max_tokens": self.max_tokens, "temperature": 0.0, "stream": True,
                    "ignore_eos": True, "cache_salt": f"stream-{n}"}
            last = None
            with httpx.stream("POST", f"{self.server.base_url}/v1/completions", json=body,
                              timeout=300) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        now = time.monotonic()
                        if last is not None:
                            self.gaps.append((now, now - last))
                        last = now
                        self.tokens += 1


    def during(self, start: float, end: float) -> list[float]:
        """The gaps that ended between ``start`` and ``end`` (time.monotonic())."""
        return [g for t, g in self.gaps if start <= t <= end]

    def report(self, start: float, end: float) -> str:
        stuck, before = self.during(start, end), self.during(0, start)
        return (f"{len(stuck)} tokens while the store was stuck ({end - start:.1f}s), max gap "
                f"{max(stuck, default=0):.3f}s; before: {len(before)} tokens, max gap "
                f"{max(before, default=0):.3f}s; overall {self.tokens} tokens, max gap "
                f"{max(g for _, g in self.gaps):.3f}s")


def fresh_sessions(server: VLLMServer, seeds: range, salt: str) -> list[list[int]]:
    return [complete_ids(server, long_text(seed, 500), f"{salt}-{seed}") for seed in seeds]


def test_a_promised_block_gone_before_its_load_is_recomputed_under_vllms_default_policy(
        tiny_model, vllm_factory, tmp_path):
    root = tmp_path / "store"
    server = start(vllm_factory, tiny_model, {"disk_path": str(root), "memory_bytes": 0})
    prompt = long_text(41, 700)
    cold = complete_ids(server, prompt, "s")
    server.stop()
    # The index still lists every block, their bytes are gone: what a load finds when
    # another process evicted the blocks after this server's lookup promised them.
    blobs = [f for f in (root / "blobs").rglob("*") if f.is_file()]
    assert blobs
    for f in blobs:
        f.unlink()
    server.start()
    assert complete_ids(server, prompt, "s") == cold           # recomputed, not failed
    assert server.metric("cwm:connector_load_failures_recomputed") >= 1
    assert server.metric("cwm:connector_load_errors") > 0
    assert server.metric("cwm:connector_loaded_blocks") == 0
    assert 'kv_load_failure_policy was \'fail\'; set to "recompute"' in server.log_text()
    # and serving goes on: the prompt is saved again and restored from the store
    server.reset_prefix_cache()
    assert complete_ids(server, prompt, "s") == cold
    assert server.metric(HITS) >= 512


def test_a_locked_disk_index_stalls_no_stream(tiny_model, vllm_factory, tmp_path):
    root = tmp_path / "store"
    # a queue of 32 saves holds a prompt's prefill; a few sessions more fill it while stuck
    store = {"disk_path": str(root), "memory_bytes": 0, "queue_depth": 32}
    server = start(vllm_factory, tiny_model, store, "--block-size", "32")
    returning = long_text(42, 600)
    cold = complete_ids(server, returning, "back")
    expected = fresh_sessions(server, range(43, 46), "control")
    server.reset_prefix_cache()
    with Streams(server) as streams:
        time.sleep(3.0)
        # held until the sessions below are answered (killing the holder lets go of the lock):
        # every arrival meets the stuck store however long any one of them takes
        holder = hold_sqlite_write_lock(root / "index.sqlite", STORE_TIMEOUT_S * 2)
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(4) as pool:
            back = pool.submit(timed, complete_ids, server, returning, "back")
            new = pool.submit(fresh_sessions, server, range(43, 46), "new")
            back_ids, returned_s = back.result()
            new_ids = new.result()
        time.sleep(max(0.0, STUCK_S - (time.monotonic() - t0)))  # stuck at least that long
        t1 = time.monotonic()
        holder.kill()
        holder.wait(timeout=60)
        time.sleep(1.0)
    print(f"{streams.report(t0, t1)}; the returning session took {returned_s:.2f}s")
    assert back_ids == cold                                      # looked up and loaded
    assert new_ids == expected                                   # computed; saves piled up
    assert returned_s < STORE_TIMEOUT_S     # it never waited out a write to the stuck index
    assert len(streams.during(t0, t1)) > 100
    assert max(g for _, g in streams.gaps) < MAX_GAP_S
    assert server.metric(HITS) >= 512                           # the returning session hit
    assert server.metric_where("cwm:connector_save_errors", reason="backpressure") > 0
    assert server.alive()


def timed(fn, *args):
    t0 = time.monotonic()
    return fn(*args), time.monotonic() - t0


@pytest.mark.redis
def test_a_blackholed_redis_stalls_no_stream(tiny_model, vllm_factory, redis_server):
    with TcpProxy(redis_server.port) as proxy:
        # a far Redis: lookups may wait longer than the bound for it (off the step, so the
        # step never does)
        store = {"redis_url": proxy.url, "redis_lookup_timeout_ms": int(MAX_GAP_S * 1250)}
        server = start(vllm_factory, tiny_model, store, recompute=True)
        expected = fresh_sessions(server, range(51, 54), "control")
        with Streams(server) as streams:
            time.sleep(3.0)
            proxy.blackhole()
            t0 = time.monotonic()
            assert fresh_sessions(server, range(51, 54), "new") == expected
            time.sleep(max(0.0, STUCK_S - (time.monotonic() - t0)))
            proxy.resume()
            t1 = time.monotonic()
            time.sleep(1.0)
        print(streams.report(t0, t1))
        assert len(streams.during(t0, t1)) > 100
        assert max(g for _, g in streams.gaps) < MAX_GAP_S
        assert server.metric("cwm:connector_lookup_timeouts") > 0
        assert server.metric("cwm:connector_lookups_deferred") > 0
        assert server.alive()
