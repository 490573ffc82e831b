"""What the memory sidecar costs: added latency with 10k chunks indexed, and a loopback load test.

    python bench/sidecar.py --json results/sidecar.json [--quick] [--upstream URL]

* A tiny random-weight model served by ``vllm serve`` on CPU (or ``--upstream``, which must
  serve a model named ``tiny``).
* Memory: one tenant's index is seeded with ``--chunks`` (10,000; ``--quick`` 2,000) chunks of
  real LoCoMo conversation text before the sidecar starts.
* The sidecar runs as its own process (``cwm serve``), like in production.
* **Latency**: the same non-streamed one-token chat, alternately straight to vLLM and through
  the sidecar (which selects memory, injects it, forwards, and records the turn before
  answering); p50/p99 of both and of the paired difference.
* **Load**: ``--clients`` concurrent clients, each with its own session, ``--turns`` turns each
  (bounded by ``--load-seconds``); afterwards every answered turn must be in the memory files.

Prints a short table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from cwm_plugin.sidecar.identity import hash_key
from cwm_plugin.testing.models import TINY, build_random_model, shared_dir
from cwm_plugin.testing.procs import free_port, stop_process_group, tail, wait_until
from cwm_plugin.testing.vllm_server import VLLMServer

log = logging.getLogger("bench.sidecar")
KEY = "bench-key-" + secrets.token_hex(8)
TENANT = "bench"


def conversation_lines() -> list[str]:
    """``speaker: text`` lines of the LoCoMo conversations in ``../shared/data``."""
    shared = shared_dir()
    if shared is None:
        raise SystemExit("no ../shared/data with LoCoMo conversations; set CWM_SHARED_DIR")
    out: list[str] = []
    for f in sorted((shared / "data").glob("**/*.json")):
        data = json.loads(f.read_text())
        conv = data.get("conversation", data)  # both layouts: nested or top-level sessions
        keys = sorted((k for k in conv if k.startswith("session_") and k[8:].isdigit()),
                      key=lambda k: int(k[8:]))
        for k in keys:
            out.extend(f"{t.get('speaker', '?')}: {t.get('text', '')}" for t in conv[k]
                       if isinstance(t, dict))
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def seed_memory(root: Path, cfg_mem: dict[str, Any], n_chunks: int) -> dict[str, Any]:
    """Write session files for the bench tenant until its index holds ``n_chunks`` chunks.

    Files are written in bulk (one durable write a session, in the memory package's own turn
    format) rather than turn by turn, then the index is built once, as the sidecar will on its
    first request (embeddings land in the on-disk cache the sidecar reuses).
    """
    from cwm_plugin.memory.files import encode_turn, replace_durable, utc_iso
    from cwm_plugin.memory.models import Turn
    from cwm_plugin.sidecar.memory_factory import make_service
    from cwm_plugin.sidecar.settings import MemorySettings

    service = make_service(MemorySettings.model_validate(cfg_mem))
    lines = conversation_lines()
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
    sessions = max(probe, math.ceil(n_chunks / per * 1.03))  # chunking varies a little
    for c in range(probe, sessions):
        write_session(c)
    copy, written = sessions, sessions * per_session
    chunks = service.reindex(TENANT, progress=False)
    seconds = time.perf_counter() - t0
    service.close()
    return {"chunks": chunks, "sessions": copy, "turns": written,
            "seed_and_index_seconds": round(seconds, 1),
            "chunk_tokens": cfg_mem["chunk_tokens"], "embedder": cfg_mem["embedder"]["kind"]}


class Sidecar:
    """``cwm serve`` as a subprocess."""

    def __init__(self, config: Path, upstream: str, work: Path, secret: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / "sidecar.log"
        cmd = [sys.executable, "-m", "cwm_plugin.cli", "serve", "--config", str(config),
               "--upstream", upstream, "--port", str(self.port), "--log-level", "warning"]
        env = {**os.environ, "CWM_SIDECAR_SECRET": secret, "HF_HUB_OFFLINE": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        wait_until(self._ready, timeout=180, alive=lambda: self.proc.poll() is None,
                   what="cwm serve", log_tail=lambda: tail(self.log))

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        stop_process_group(self.proc)


def chat_body(question: str, system: str) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 1, "temperature": 0.0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}


def latency(sidecar: Sidecar, upstream: str, questions: list[str], system: str) -> dict[str, Any]:
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


async def load(sidecar: Sidecar, clients: int, turns: int, seconds: float,
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


def sidecar_means(sidecar: Sidecar) -> dict[str, float]:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--upstream", help="reuse a vLLM that serves the tiny model as `tiny`")
    ap.add_argument("--chunks", type=int)
    ap.add_argument("--requests", type=int)
    ap.add_argument("--clients", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--load-seconds", type=float, default=240.0)
    ap.add_argument("--embedder", default=None,
                    help="hashing | local (default: local, quick: hashing)")
    ap.add_argument("--chunk-tokens", type=int, default=64,
                    help="chunk size of the seeded index (small, so 10k chunks stay quick)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    q = args.quick
    chunks = args.chunks or (2000 if q else 10_000)
    n_req = args.requests or (40 if q else 200)
    clients = args.clients or (4 if q else 8)
    turns = args.turns or (5 if q else 10)
    embedder = args.embedder or ("hashing" if q else "local")

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
        seeded = seed_memory(root, cfg_mem, chunks)
        log.info("seeded: %s", seeded)
        secret = secrets.token_hex(32)
        config = work / "sidecar.yaml"
        config.write_text(yaml.safe_dump({
            "tenants": [{"name": TENANT, "key_sha256": [hash_key(KEY)]}], "memory": cfg_mem}))
        sidecar = Sidecar(config, upstream, work, secret)
        lines = conversation_lines()
        questions = [ln.partition(": ")[2] or ln for ln in lines[::7]]
        system = "You are a helpful assistant that remembers the user's conversations."
        t0 = time.perf_counter()
        warm = httpx.post(f"{sidecar.url}/v1/chat/completions", json=chat_body("hello", system),
                          headers={"Authorization": f"Bearer {KEY}", "X-Session-Id": "warm"},
                          timeout=600)
        warm.raise_for_status()
        first_request_s = round(time.perf_counter() - t0, 2)  # loads the index from the files
        log.info("latency: %d paired requests (first request %.1fs)", n_req, first_request_s)
        lat = latency(sidecar, upstream, questions[: n_req + 3], system)
        lat["first_request_s"] = first_request_s
        log.info("load: %d clients x %d turns", clients, turns)
        ld = asyncio.run(load(sidecar, clients, turns, args.load_seconds, questions))
        done = ld.pop("_done")
        inside = sidecar_means(sidecar)
        sidecar.stop()
        sidecar = None
        check = verify_memory(root, done)
    finally:
        if sidecar is not None:
            sidecar.stop()
        if vllm is not None:
            vllm.stop()
    result = {"quick": q, "seed": seeded, "latency": lat, "load": ld, "memory_check": check,
              "inside_sidecar": inside}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nmemory: {seeded['chunks']} chunks of <= {seeded['chunk_tokens']} tokens "
          f"({seeded['turns']} turns, {seeded['embedder']} embeddings), written and indexed in "
          f"{seeded['seed_and_index_seconds']} s; sidecar's first request {lat['first_request_s']} s")
    print(f"{'':24}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'direct to vLLM':24}{lat['direct_p50_ms']:>10}{lat['direct_p99_ms']:>10}")
    print(f"{'through the sidecar':24}{lat['sidecar_p50_ms']:>10}{lat['sidecar_p99_ms']:>10}")
    print(f"{'added (paired)':24}{lat['added_p50_ms']:>10}{lat['added_p99_ms']:>10}")
    print(f"inside the sidecar (all requests): memory selection {inside['retrieval_mean_ms']} ms"
          f" mean, everything before forwarding {inside['overhead_mean_ms']} ms mean")
    print(f"load: {ld['clients']} clients, {ld['answered']} turns in {ld['wall_s']} s "
          f"({ld['turns_per_s']}/s), errors {ld['errors']}, p50 {ld['p50_ms']} ms, "
          f"p99 {ld['p99_ms']} ms; turns missing from memory: {check['missing']}")
    return 0 if check["missing"] == 0 and ld["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
