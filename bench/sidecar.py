"""What the memory sidecar costs and buys: added latency with 10k chunks indexed, a loopback
load test, and the prefix-cache hit rate with and without cache-aware injection.

    python bench/sidecar.py --json results/sidecar.json [--quick] [--upstream URL] [--data DIR]

* A tiny random-weight model served by ``vllm serve`` on CPU (or ``--upstream``, which must
  serve a model named ``tiny``).
* Memory: one tenant's index is seeded with ``--chunks`` (10,000; ``--quick`` 2,000) chunks of
  about ``--chunk-tokens`` (400, with 80 overlap: the sidecar's defaults) tokens of real LoCoMo
  conversation text (``--data``: any folder of LoCoMo files, flat or lists of samples like
  locomo10.json; default ``../shared/data``), embedded with MiniLM (``--quick``: the hashing
  embedder). The index is built and saved before the sidecar starts, which loads it.
* The sidecar runs as its own process (``cwm serve``), like in production.
* **Latency**: the same non-streamed one-token chat, alternately straight to vLLM and through
  the sidecar (which selects memory, injects it, forwards, and records the turn before
  answering); p50/p99 of both and of the paired difference.
* **Load**: ``--clients`` concurrent clients, each with its own session, ``--turns`` turns each
  (bounded by ``--load-seconds``); afterwards every answered turn must be in the memory files.
* **Prefix cache**: the same conversation (a long system prompt, then ``--prefix-turns``
  questions, the client sending its whole history each time) replayed through a sidecar with
  ``injection: cache_aware`` (memory after the stable prefix) and one with ``memory_first``
  (memory before it), each in a fresh session; vLLM's ``prefix_cache_hits / queries`` over each
  replay, and their ratio.

Prints tables and writes JSON (``latency``, ``load``, ``memory_check``, ``prefix_cache``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from _common import machine, table, write_json
from memory import sessions, turn_text

from cwm_plugin.sidecar.identity import hash_key
from cwm_plugin.sidecar.metrics import upstream_counters
from cwm_plugin.testing import locomo
from cwm_plugin.testing.models import TINY, build_random_model, shared_dir
from cwm_plugin.testing.sidecar_process import SidecarProcess
from cwm_plugin.testing.vllm_server import VLLMServer

log = logging.getLogger("bench.sidecar")
KEY = "bench-key-" + secrets.token_hex(8)
TENANT = "bench"


def conversation_lines(data: Path | None = None) -> list[str]:
    """``speaker: text`` lines of the LoCoMo conversations under ``data`` (every folder in it;
    default ``../shared/data``), in any layout ``bench/memory.py`` reads."""
    if data is None:
        shared = shared_dir()
        if shared is None:
            raise SystemExit("no ../shared/data with LoCoMo conversations; pass --data or set "
                             "CWM_SHARED_DIR")
        data = shared / "data"
    out: list[str] = []
    for conv in locomo.load_conversations(data):
        for _, _, turns in sessions(conv.sessions):
            out.extend(f"{t.get('speaker', '?')}: {turn_text(t)}" for t in turns
                       if isinstance(t, dict))
    if not out:
        raise SystemExit(f"no LoCoMo conversations under {data}")
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def seed_memory(root: Path, cfg_mem: dict[str, Any], n_chunks: int,
                lines: list[str]) -> dict[str, Any]:
    """Write session files for the bench tenant until its index holds ``n_chunks`` chunks.

    Files are written in bulk (one durable write a session, in the memory package's own turn
    format) rather than turn by turn, then the index is built once and saved under the memory
    root (``cwm memory reindex`` does the same); the sidecar loads it when it starts.
    """
    from cwm_plugin.memory.files import encode_turn, replace_durable, utc_iso
    from cwm_plugin.memory.models import Turn
    from cwm_plugin.sidecar.memory_factory import make_service
    from cwm_plugin.sidecar.settings import MemorySettings

    service = make_service(MemorySettings.model_validate(cfg_mem))
    per_session = 100

    def write_session(copy: int) -> None:
        turns = []
        for i in range(per_session):
            speaker, _, text = lines[(copy * per_session + i) % len(lines)].partition(": ")
            turns.append(Turn(f"s{copy}-{i}", "user" if i % 2 == 0 else "assistant",
                              f"({speaker}, copy {copy}) {text}", utc_iso()))
        path = service.files.session_path(TENANT, f"seed-{copy:04d}")
        replace_durable(path, b"".join(encode_turn(t) for t in turns).decode())

    t0 = time.perf_counter()
    probe = 5
    for c in range(probe):
        write_session(c)
    per = service.reindex(TENANT, progress=False) / probe  # chunks a session
    copy = max(probe, math.ceil(n_chunks / per * 1.02))
    for c in range(probe, copy):
        write_session(c)
    log.info("indexing %d sessions (embedding every line: minutes with MiniLM)", copy)
    chunks = service.reindex(TENANT, progress=True)
    while chunks < n_chunks:  # chunking varies a little: top up until there are enough
        more = max(1, math.ceil((n_chunks - chunks) / per * 1.02))
        for c in range(copy, copy + more):
            write_session(c)
        copy += more
        chunks = len(service.index(TENANT).chunks)  # indexes only the new sessions
    seconds = time.perf_counter() - t0
    service.close()  # saves the index the sidecar will load
    return {"chunks": chunks, "sessions": copy, "turns": copy * per_session,
            "seed_and_index_seconds": round(seconds, 1),
            "chunk_tokens": cfg_mem["chunk_tokens"], "embedder": cfg_mem["embedder"]["kind"]}


def chat_body(question: str, system: str) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 1, "temperature": 0.0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}


def latency(sidecar: SidecarProcess, upstream: str, questions: list[str], system: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEY}", "X-Session-Id": "latency"}
    direct: list[float] = []
    proxied: list[float] = []
    with httpx.Client(timeout=120) as client:
        for i, q in enumerate(questions):
            body = chat_body(q, system)
            t0 = time.perf_counter()
            r = client.post(f"{upstream}/v1/chat/completions",
                            json={**body, "cache_salt": "bench-direct"})
            t1 = time.perf_counter()
            r.raise_for_status()
            s = client.post(f"{sidecar.url}/v1/chat/completions", json=body, headers=headers)
            t2 = time.perf_counter()
            s.raise_for_status()
            if i >= 3:  # warm-up
                direct.append(t1 - t0)
                proxied.append(t2 - t1)
    diffs = [p - d for p, d in zip(proxied, direct, strict=True)]
    ms = lambda xs, p: round(pct(xs, p) * 1000, 2)  # noqa: E731
    return {"requests": len(direct),
            "direct_p50_ms": ms(direct, 50), "direct_p99_ms": ms(direct, 99),
            "sidecar_p50_ms": ms(proxied, 50), "sidecar_p99_ms": ms(proxied, 99),
            "added_p50_ms": ms(diffs, 50), "added_p99_ms": ms(diffs, 99),
            "added_mean_ms": round(statistics.fmean(diffs) * 1000, 2)}


async def load(sidecar: SidecarProcess, clients: int, turns: int, seconds: float,
               questions: list[str]) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    done: dict[str, list[str]] = {}
    errors: list[str] = []
    lat: list[float] = []

    async def client(i: int, http: httpx.AsyncClient) -> None:
        session = f"load-{i}"
        done[session] = []
        for t in range(turns):
            if time.monotonic() > deadline:
                return
            q = f"[{session} turn {t}] {questions[(i * turns + t) % len(questions)]}"
            t0 = time.perf_counter()
            r = await http.post(f"{sidecar.url}/v1/chat/completions",
                                json={"model": "tiny", "max_tokens": 4, "temperature": 0.0,
                                      "messages": [{"role": "user", "content": q}]},
                                headers={"Authorization": f"Bearer {KEY}",
                                         "X-Session-Id": session})
            lat.append(time.perf_counter() - t0)
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:120]}")
                continue
            done[session].append(q)

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=clients * 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        await asyncio.gather(*(client(i, http) for i in range(clients)))
    wall = time.perf_counter() - t0
    answered = sum(len(v) for v in done.values())
    return {"clients": clients, "turns_per_client": turns, "answered": answered,
            "errors": len(errors), "error_samples": errors[:3], "wall_s": round(wall, 2),
            "turns_per_s": round(answered / wall, 2),
            "p50_ms": round(pct(lat, 50) * 1000, 1), "p99_ms": round(pct(lat, 99) * 1000, 1),
            "_done": done}


def sidecar_means(sidecar: SidecarProcess) -> dict[str, float]:
    """Mean memory-selection time and mean time before forwarding, from the sidecar's metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{sidecar.url}/metrics", timeout=30).text
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            sums[smp.name] = sums.get(smp.name, 0.0) + smp.value
    out = {}
    for name in ("retrieval", "overhead"):
        n = sums.get(f"cwm_sidecar_{name}_seconds_count", 0.0)
        out[f"{name}_mean_ms"] = round(1000 * sums.get(f"cwm_sidecar_{name}_seconds_sum", 0) /
                                       n, 2) if n else float("nan")
    return out


def verify_memory(root: Path, done: dict[str, list[str]]) -> dict[str, Any]:
    """Every answered user turn, and an assistant turn for each, is in the session's file."""
    from cwm_plugin.memory.files import MemoryFiles

    files = MemoryFiles(root)
    missing = 0
    for session, questions in done.items():
        turns = [t.as_dict() for t in files.read_turns(TENANT, session)]
        users = [t["content"] for t in turns if t["role"] == "user"]
        assistants = sum(1 for t in turns if t["role"] == "assistant")
        missing += sum(1 for q in questions if q not in users)
        missing += max(0, len(questions) - assistants)
    return {"sessions": len(done), "turns_checked": sum(map(len, done.values())),
            "missing": missing}


SYSTEM = ("You are the assistant of a travel desk that remembers its customers' earlier "
          "conversations. Answer briefly and precisely; when the relevant memory does not say, "
          "say that you do not know rather than guessing. Keep names, dates and numbers exact. "
          "Prefer the customer's stated preferences; mention prices only when asked. ") * 4


def prefix_cache(config: Path, upstream: str, work: Path, secret: str, questions: list[str],
                 mode: str) -> dict[str, Any]:
    """Replay one conversation through a sidecar with ``injection: mode``; vLLM's prefix-cache
    counters over the replay (a fresh session, so a fresh salt: no earlier KV can hit)."""
    raw = yaml.safe_load(config.read_text())
    path = work / f"sidecar-{mode}.yaml"
    path.write_text(yaml.safe_dump({**raw, "injection": mode}))
    sidecar = SidecarProcess(path, upstream, work, secret).start()
    headers = {"Authorization": f"Bearer {KEY}", "X-Session-Id": f"prefix-{mode}"}
    history = [{"role": "system", "content": SYSTEM}]
    try:
        before = upstream_counters(httpx.get(f"{upstream}/metrics", timeout=30).text)
        with httpx.Client(timeout=300) as client:
            for q in questions:
                history.append({"role": "user", "content": q})
                r = client.post(f"{sidecar.url}/v1/chat/completions", headers=headers,
                                json={"model": "tiny", "messages": history, "max_tokens": 4,
                                      "temperature": 0.0})
                r.raise_for_status()
                history.append({"role": "assistant",
                                "content": r.json()["choices"][0]["message"]["content"]})
        after = upstream_counters(httpx.get(f"{upstream}/metrics", timeout=30).text)
    finally:
        sidecar.stop()
    hits = after.get("vllm:prefix_cache_hits", 0) - before.get("vllm:prefix_cache_hits", 0)
    queries = after.get("vllm:prefix_cache_queries", 0) - \
        before.get("vllm:prefix_cache_queries", 0)
    return {"turns": len(questions), "hits": int(hits), "queries": int(queries),
            "hit_rate": round(hits / queries, 4) if queries else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--upstream", help="reuse a vLLM that serves the tiny model as `tiny`")
    ap.add_argument("--data", type=Path, help="folder of LoCoMo conversations")
    ap.add_argument("--chunks", type=int)
    ap.add_argument("--requests", type=int)
    ap.add_argument("--clients", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--prefix-turns", type=int)
    ap.add_argument("--load-seconds", type=float, default=240.0)
    ap.add_argument("--embedder", default=None,
                    help="hashing | local (default: local, quick: hashing)")
    ap.add_argument("--chunk-tokens", type=int, default=400,
                    help="chunk size of the seeded index (the sidecar's default)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    q = args.quick
    chunks = args.chunks or (2000 if q else 10_000)
    n_req = args.requests or (40 if q else 200)
    clients = args.clients or (4 if q else 8)
    turns = args.turns or (5 if q else 10)
    prefix_turns = args.prefix_turns or (8 if q else 20)
    embedder = args.embedder or ("hashing" if q else "local")
    lines = conversation_lines(args.data)

    work = Path(tempfile.mkdtemp(prefix="cwm-bench-sidecar-"))
    model = build_random_model(TINY)
    vllm = None
    upstream = args.upstream
    if upstream is None:
        vllm = VLLMServer(model_dir=model, log_dir=work).start()
        upstream = vllm.base_url
    sidecar = None
    try:
        root = work / "memory"
        cfg_mem = {"root": str(root), "tokenizer": str(model), "embedder": {"kind": embedder},
                   "chunk_tokens": args.chunk_tokens, "chunk_overlap": args.chunk_tokens // 5,
                   "summary_every_turns": 0, "extract_facts": False}
        log.info("seeding %d chunks (%s embeddings, %d-token chunks)", chunks, embedder,
                 args.chunk_tokens)
        seeded = seed_memory(root, cfg_mem, chunks, lines)
        log.info("seeded: %s", seeded)
        secret = secrets.token_hex(32)
        config = work / "sidecar.yaml"
        config.write_text(yaml.safe_dump({
            "tenants": [{"name": TENANT, "key_sha256": [hash_key(KEY)]}], "memory": cfg_mem}))
        t0 = time.perf_counter()
        sidecar = SidecarProcess(config, upstream, work, secret).start()
        start_s = round(time.perf_counter() - t0, 2)
        questions = [ln.partition(": ")[2] or ln for ln in lines[::7]]
        t0 = time.perf_counter()
        warm = httpx.post(f"{sidecar.url}/v1/chat/completions",
                          json=chat_body("hello", SYSTEM),
                          headers={"Authorization": f"Bearer {KEY}", "X-Session-Id": "warm"},
                          timeout=600)
        warm.raise_for_status()
        first_request_s = round(time.perf_counter() - t0, 2)
        log.info("latency: %d paired requests (first request %.1fs)", n_req, first_request_s)
        lat = latency(sidecar, upstream, questions[: n_req + 3], SYSTEM)
        lat.update(first_request_s=first_request_s, sidecar_start_s=start_s)
        log.info("load: %d clients x %d turns", clients, turns)
        ld = asyncio.run(load(sidecar, clients, turns, args.load_seconds, questions))
        done = ld.pop("_done")
        inside = sidecar_means(sidecar)
        sidecar.stop()
        sidecar = None
        check = verify_memory(root, done)
        log.info("prefix cache: %d turns, cache_aware vs memory_first", prefix_turns)
        convo = questions[-prefix_turns:]
        prefix = {mode: prefix_cache(config, upstream, work, secret, convo, mode)
                  for mode in ("cache_aware", "memory_first")}
        aware, first = (prefix[m]["hit_rate"] for m in ("cache_aware", "memory_first"))
        prefix["ratio"] = round(aware / first, 3) if aware and first else None  # JSON: no inf
    finally:
        if sidecar is not None:
            sidecar.stop()
        if vllm is not None:
            vllm.stop()
    result = {"quick": q, "machine": machine(), "seed": seeded, "latency": lat, "load": ld,
              "memory_check": check, "inside_sidecar": inside, "prefix_cache": prefix}
    print(f"\nmemory: {seeded['chunks']} chunks of <= {seeded['chunk_tokens']} tokens "
          f"({seeded['turns']} turns, {seeded['embedder']} embeddings), written, indexed and "
          f"saved in {seeded['seed_and_index_seconds']} s; sidecar ready in "
          f"{lat['sidecar_start_s']} s (loads the saved index), first request "
          f"{lat['first_request_s']} s")
    print(table([{"": "direct to vLLM", "p50 ms": lat["direct_p50_ms"],
                  "p99 ms": lat["direct_p99_ms"]},
                 {"": "through the sidecar", "p50 ms": lat["sidecar_p50_ms"],
                  "p99 ms": lat["sidecar_p99_ms"]},
                 {"": "added (paired)", "p50 ms": lat["added_p50_ms"],
                  "p99 ms": lat["added_p99_ms"]}], ["", "p50 ms", "p99 ms"]))
    print(f"inside the sidecar (all requests): memory selection {inside['retrieval_mean_ms']} ms"
          f" mean, everything before forwarding {inside['overhead_mean_ms']} ms mean")
    print(f"load: {ld['clients']} clients, {ld['answered']} turns in {ld['wall_s']} s "
          f"({ld['turns_per_s']}/s), errors {ld['errors']}, p50 {ld['p50_ms']} ms, "
          f"p99 {ld['p99_ms']} ms; turns missing from memory: {check['missing']}")
    print(table([{"injection": m, "hits": prefix[m]["hits"], "queries": prefix[m]["queries"],
                  "hit rate": prefix[m]["hit_rate"]} for m in ("cache_aware", "memory_first")],
                ["injection", "hits", "queries", "hit rate"]))
    if prefix["ratio"] is not None:
        print(f"prefix-cache hit rate, cache_aware / memory_first: {prefix['ratio']}")
    else:  # a zero rate on either side: no finite ratio, the rates say it all
        print(f"prefix-cache hit rate: cache_aware {prefix['cache_aware']['hit_rate']}, "
              f"memory_first {prefix['memory_first']['hit_rate']} (no finite ratio)")
    write_json(args.json, result)
    return 0 if check["missing"] == 0 and ld["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
