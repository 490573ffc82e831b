"""What the memory sidecar costs and buys, against a client talking to vLLM directly.

    python bench/sidecar.py --chunks N --json FILE [--quick] [--upstream URL]

* **Import**: one tenant's memory gets ``--chunks`` chunks of conversation text (the generated
  conversations, :mod:`cwm_plugin.testing.conversations.dialogues`) with ``cwm memory
  import``'s code (MiniLM, the sidecar's chunk settings), in tokens/s, against the plain
  seeding path (session files, then a reindex: each line embedded with the line before it,
  sessions one by one, on torch's threads) timed on ``--baseline-chunks`` chunks in the same
  run, before and after the import (a machine's speed drifts over minutes), in two
  precisions: MiniLM in float32 (``speedup_per_chunk_as_filed``) and in the precision this CPU
  computes in (bfloat16 where it has it: ``speedup_per_chunk``, the figure that credits the
  import only with what is its own): seconds per chunk, and the ratios.
* **Overhead**: ``--requests`` chats through ``cwm serve`` (its own process), as conversations
  of ``--conv-turns`` turns whose client replays its history, each in its own session, each
  request sent once the sidecar finished indexing the previous turn (a person's reading time;
  the load phase has no pause); the sidecar's own time per request (everything but the
  upstream's time) from its ``Server-Timing`` header, p50/p99, and where it goes (auth,
  history, query embedding, keyword and vector search, fusion, token counting, file I/O).
  Measured twice: in front of a null upstream answering at once (the sidecar alone: the
  ``overhead_*`` keys), and in front of the tiny model's ``vllm serve`` on the same two cores
  (``overhead_with_vllm_*``; vLLM-CPU keeps a core busy even when idle).
* **Load**: ``--clients`` concurrent clients x ``--turns`` turns; errors, and answered turns
  missing from the memory files afterwards (``turns_lost``).
* **Prefix cache**: a ``--prefix-turns``-turn conversation whose client replays its whole
  history: vLLM's prefix-cache hit rate through the sidecar (memory in every turn) and for the
  same client talking to vLLM directly; each memory placement on the tiny model, the default
  one on the real SmolLM2 (``--hit-model``).
* **Token saving** (``X-CWM-History: recent``): prompt tokens sent / a full-history replay,
  over questions in a session holding a whole conversation.

Prints tables and writes JSON with ``overhead_p50_ms``, ``overhead_p99_ms`` (and
``overhead_with_vllm_p50_ms``, ``overhead_with_vllm_p99_ms``),
``prefix_hit_rate_sidecar``, ``prefix_hit_rate_direct``, ``tokens_sent_ratio``,
``import_tokens_per_s``, ``load_errors``, ``turns_lost`` and the details.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing
import os
import secrets
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml
from _common import machine, percentile, table, write_json
from _sidecar_client import KEY, SYSTEM, post, prefix_runs

from cwm_plugin.compute_dtype import compute_dtype
from cwm_plugin.memory.service.importer import ImportedConversation, import_sessions
from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.testing.conversations.dialogues import default_conversations
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.models import TINY, build_random_model, build_smollm2
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.testing.sidecar_process import SidecarProcess
from cwm_plugin.testing.vllm_server import VLLMServer

log = logging.getLogger("bench.sidecar")
TENANT = "bench"
FOLDER = TENANT  # its memory folder: a tenant's own is named after it
PER_SESSION = 100
STAGES = ("auth", "history", "embed", "keyword", "vector", "fusion", "count", "files")


def copies(lines: list[str], first: int, n: int) -> list[ImportedConversation]:
    """``n`` sessions of ``PER_SESSION`` turns of conversation, each copy marked apart."""
    out = []
    for c in range(first, first + n):
        turns = []
        for i in range(PER_SESSION):
            speaker, _, text = lines[(c * PER_SESSION + i) % len(lines)].partition(": ")
            turns.append(("user" if i % 2 == 0 else "assistant", f"({speaker}, copy {c}) {text}"))
        out.append(ImportedConversation(f"seed-{c:05d}", turns))
    return out


def baseline_seed(root: Path, cfg_mem: dict[str, Any], lines: list[str], chunks: int,
                  dtype: str) -> dict:
    """The plain seeding path: whole session files written, then ``reindex`` (sessions one by
    one, each session's lines embedded in file order, each with the line before it, on torch's
    default threads), MiniLM in ``dtype``."""
    from cwm_plugin.memory.files.durable import replace_durable
    from cwm_plugin.memory.files.markdown import encode_turn, utc_iso
    from cwm_plugin.memory.models import Turn
    from cwm_plugin.memory.service.factory import service_from_settings
    from cwm_plugin.memory.settings import MemorySettings

    before = {**cfg_mem, "root": str(root), "vector_context_mode": "pair",  # lines in pairs
              "embedder": {**cfg_mem["embedder"], "threads": None, "dtype": dtype}}
    service = service_from_settings(MemorySettings.model_validate(before))
    n = max(1, math.ceil(chunks / 14))
    t0 = time.perf_counter()
    for k, conv in enumerate(copies(lines, 90_000, n)):  # text no import below repeats
        records = [Turn(f"b{k}-{i}", r, t, utc_iso()) for i, (r, t) in enumerate(conv.turns)]
        replace_durable(service.files.session_path(FOLDER, conv.session),
                        b"".join(encode_turn(t) for t in records).decode())
    made = service.reindex(FOLDER, progress=False)
    seconds = time.perf_counter() - t0
    tokens = sum(u.tokens for st in service.index(FOLDER).sessions.values() for u in st.units)
    used = getattr(getattr(service.embedder, "inner", service.embedder), "dtype_used", dtype)
    service.close()
    return {"chunks": made, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds), "s_per_chunk": seconds / made, "dtype": used}


def fresh(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a new process: a baseline timed in this one after the import would run
    slower (the import's heap stays behind), which is no property of the baseline."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def pooled(runs: list[dict]) -> dict:
    """Baseline runs of one precision taken as one: totals, and each run kept."""
    chunks, tokens = sum(r["chunks"] for r in runs), sum(r["tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    return {"chunks": chunks, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds), "s_per_chunk": seconds / chunks,
            "dtype": runs[0]["dtype"], "runs": runs}


def import_memory(root: Path, cfg_mem: dict[str, Any], lines: list[str], chunks: int,
                  whole: ImportedConversation) -> dict:
    """``cwm memory import``'s path until the folder holds ``chunks`` chunks (plus ``whole``,
    one session with a whole conversation, for the token-saving measurement)."""
    from cwm_plugin.memory.service.factory import service_from_settings
    from cwm_plugin.memory.settings import MemorySettings

    service = service_from_settings(MemorySettings.model_validate(cfg_mem))
    done = tokens = 0
    seconds = 0.0
    first = 0
    batch = [whole, *copies(lines, first, max(1, math.ceil(chunks / 14)))]
    while done < chunks:
        stats = import_sessions(service, FOLDER, batch, progress=True,
                                workers=os.cpu_count() or 1)
        done, tokens, seconds = done + stats.chunks, tokens + stats.tokens, \
            seconds + stats.seconds
        first += len(batch)
        batch = copies(lines, first, max(1, math.ceil((chunks - done) / 14 * 1.05)))
    service.close()
    return {"chunks": done, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds), "s_per_chunk": seconds / done}


def server_timing(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


def settle(client: httpx.Client, url: str, limit_s: float = 5.0) -> None:
    """Wait until the sidecar's background work (indexing the last turn) is done, as it is
    when a person reads an answer before sending the next message. ``/health`` shows the
    count only to a key with the ``admin`` grant: without it there is nothing to wait on."""
    deadline = time.monotonic() + limit_s
    while True:
        got = client.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}).json()
        if "background_tasks" not in got:
            raise RuntimeError(f"/health shows no background_tasks (admin grant?): {got}")
        if not got["background_tasks"] or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def overhead(sidecar: SidecarProcess, questions: list[str], n: int, turns: int,
             label: str = "over") -> dict:
    """Sidecar time per request (``Server-Timing``), conversations replaying their history,
    each request sent once the previous turn's background work is done (``settle``)."""
    rows: list[dict[str, float]] = []
    firsts: list[float] = []
    with httpx.Client(timeout=300) as client:
        for c in range(math.ceil(n / turns) + 1):  # the first conversation warms up
            history = [{"role": "system", "content": SYSTEM}]
            for t in range(turns):
                settle(client, sidecar.url)
                history.append({"role": "user", "content": questions[(c * turns + t)
                                                                     % len(questions)]})
                r = post(client, sidecar.url, {"model": "tiny", "messages": history,
                                               "max_tokens": 4, "temperature": 0.0},
                         f"{label}-{c}")
                history.append({"role": "assistant", "content":
                                r.json()["choices"][0]["message"]["content"] or ""})
                if c:
                    rows.append(server_timing(r.headers["server-timing"]))
                    if t == 0:
                        firsts.append(rows[-1]["total"])
    rows = rows[:n]
    totals = [r["total"] for r in rows]
    stages = {s: {"p50": round(percentile([r.get(s, 0.0) for r in rows], 50), 3),
                  "p99": round(percentile([r.get(s, 0.0) for r in rows], 99), 3),
                  "mean": round(sum(r.get(s, 0.0) for r in rows) / len(rows), 3)}
              for s in (*STAGES, *sorted({k for r in rows for k in r} - {*STAGES, "total"}))}
    return {"requests": len(rows), "turns_per_conversation": turns,
            "p50_ms": round(percentile(totals, 50), 2), "p99_ms": round(percentile(totals, 99), 2),
            "first_turn_p50_ms": round(percentile(firsts, 50), 2),
            "first_turn_p99_ms": round(percentile(firsts, 99), 2), "stages": stages}


async def load(sidecar: SidecarProcess, clients: int, turns: int, questions: list[str]) -> dict:
    done: dict[str, list[str]] = {}
    errors: list[str] = []

    async def client(i: int, http: httpx.AsyncClient) -> None:
        session = done.setdefault(f"load-{i}", [])
        for t in range(turns):
            q = f"[load-{i} turn {t}] {questions[(i * turns + t) % len(questions)]}"
            r = await http.post(f"{sidecar.url}/v1/chat/completions",
                                json={"model": "tiny", "max_tokens": 4, "temperature": 0.0,
                                      "messages": [{"role": "user", "content": q}]},
                                headers={"Authorization": f"Bearer {KEY}",
                                         "X-Session-Id": f"load-{i}"})
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:120]}")
            else:
                session.append(q)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as http:
        await asyncio.gather(*(client(i, http) for i in range(clients)))
    return {"clients": clients, "turns": turns, "errors": len(errors),
            "error_samples": errors[:3], "wall_s": round(time.perf_counter() - t0, 2),
            "_done": done}


def turns_lost(root: Path, done: dict[str, list[str]]) -> int:
    """Answered user turns (and an answer for each) missing from the session files."""
    from cwm_plugin.memory.files.markdown import MemoryFiles

    files, lost = MemoryFiles(root), 0
    for session, questions in done.items():
        turns = files.read_turns(FOLDER, session)
        users = {t.content for t in turns if t.role == "user"}
        lost += sum(q not in users for q in questions)
        lost += max(0, len(questions) - sum(t.role == "assistant" for t in turns))
    return lost


def token_saving(sidecar: SidecarProcess, session: str, questions: list[str]) -> dict:
    sent = full = 0
    with httpx.Client(timeout=300) as client:
        for q in questions:
            r = post(client, sidecar.url, {"model": "tiny", "max_tokens": 4, "messages": [
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]},
                session, {"X-CWM-History": "recent"})
            debug = json.loads(r.headers["x-cwm-memory"])
            sent, full = sent + debug["sent"], full + debug["full"]
    return {"questions": len(questions), "sent": sent, "full_replay": full,
            "ratio": round(sent / full, 4) if full else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="2,000 chunks, fewer requests")
    ap.add_argument("--upstream", help="reuse a vLLM serving the tiny model as `tiny` "
                                       "(with --max-model-len 8192)")
    ap.add_argument("--chunks", type=int)
    ap.add_argument("--baseline-chunks", type=int, default=200)
    ap.add_argument("--requests", type=int)
    ap.add_argument("--conv-turns", type=int, default=10)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--prefix-turns", type=int, default=32)
    ap.add_argument("--hit-model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--embedder", default="local", help="local (MiniLM) | hashing")
    ap.add_argument("--chunk-tokens", type=int, default=400)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    chunks = args.chunks or (2000 if args.quick else 10_000)
    n_req = args.requests or (60 if args.quick else 200)
    convs = default_conversations()
    lines = [ln for c in convs for ln in c.lines()]
    questions = [ln.partition(": ")[2] or ln for ln in lines[::7]]
    talk = [ln for ln in convs[0].lines()][:args.prefix_turns]
    work = Path(tempfile.mkdtemp(prefix="cwm-bench-sidecar-"))
    model = build_random_model(TINY)
    root = work / "memory"
    cfg_mem = {"root": str(root), "tokenizer": str(model), "embedder": {"kind": args.embedder},
               "chunk_tokens": args.chunk_tokens, "chunk_overlap": args.chunk_tokens // 5,
               "summary_every_turns": 0, "extract_facts": False}
    t_start = time.perf_counter()
    log.info("baseline: the seeding of before, %d chunks, float32 as filed and today's "
             "precision, before and after the import", args.baseline_chunks)
    runs = [fresh(baseline_seed, work / f"baseline-{dtype}-before", cfg_mem, lines,
                  args.baseline_chunks, dtype) for dtype in ("float32", "auto")]
    log.info("import: %d chunks", chunks)
    whole = ImportedConversation("whole-conversation",
                                 [(ln.partition(": ")[0], ln.partition(": ")[2])
                                  for ln in convs[-1].lines()])
    imp = import_memory(root, cfg_mem, lines, chunks, whole)
    runs += [fresh(baseline_seed, work / f"baseline-{dtype}-after", cfg_mem, lines,
                   args.baseline_chunks, dtype) for dtype in ("float32", "auto")]
    filed, base = pooled(runs[0::2]), pooled(runs[1::2])  # the machine's speed drifts
    imp["speedup_per_chunk"] = round(base["s_per_chunk"] / imp["s_per_chunk"], 2)
    imp["speedup_per_chunk_as_filed"] = round(filed["s_per_chunk"] / imp["s_per_chunk"], 2)
    secret = secrets.token_hex(32)
    config = work / "sidecar.yaml"
    config.write_text(yaml.safe_dump({
        "tenants": [{"name": TENANT, "key_sha256": [hash_key(KEY)]}], "memory": cfg_mem,
        "access": {"grants": {TENANT: ["debug", "admin"]}},  # X-CWM-Memory; /health's tasks
        # the sidecar's own time is measured, not the default per-tenant limits
        "rate_limits": {"rate_limit": "none", "token_quota": "none"}}))
    log.info("overhead, null upstream: %d requests", n_req)
    with ServerThread(FakeUpstream(model="tiny", max_model_len=8192).app) as null, \
            SidecarProcess(config, null.url, work, secret) as sidecar:
        alone = overhead(sidecar, questions[len(questions) // 2:], n_req, args.conv_turns,
                         "alone")
    vllm = None if args.upstream else VLLMServer(model_dir=model, log_dir=work,
                                                 max_model_len=8192).start()
    upstream = args.upstream or vllm.base_url
    try:
        with SidecarProcess(config, upstream, work, secret) as sidecar:
            log.info("overhead: %d requests", n_req)
            over = overhead(sidecar, questions, n_req, args.conv_turns)
            log.info("load: %d clients x %d turns", args.clients, args.turns)
            ld = asyncio.run(load(sidecar, args.clients, args.turns, questions))
            saving = token_saving(sidecar, whole.session, questions[:10])
        lost = turns_lost(root, ld.pop("_done"))
        log.info("prefix cache (tiny): placements over %d turns", len(talk))
        placements = [{"placement": "system", "refresh": "conversation"},
                      {"placement": "system", "refresh": "turn"},
                      {"placement": "last_user", "refresh": "turn"}]
        tiny_runs = prefix_runs(config, upstream, work, secret, "tiny", talk, placements)
    finally:
        if vllm is not None:
            vllm.stop()
    hit = tiny_runs
    if args.hit_model == "smollm2":
        log.info("prefix cache (SmolLM2): default placement vs direct, %d turns", len(talk))
        folder = build_smollm2()
        small = VLLMServer(model_dir=folder, served_name="smollm2", dtype=compute_dtype(),
                           max_model_len=8192, kv_cache_gib=2, log_dir=work).start()
        try:  # counted with SmolLM2's own tokenizer (its folder, from vLLM's /v1/models)
            hit = prefix_runs(config, small.base_url, work, secret, "smollm2", talk,
                              placements[:1], {"tokenizer": "auto"})
        finally:
            small.stop()
    default = hit["system/conversation"]
    result = {
        "machine": machine(), "chunks": imp["chunks"],
        "overhead_p50_ms": alone["p50_ms"], "overhead_p99_ms": alone["p99_ms"],
        "overhead_with_vllm_p50_ms": over["p50_ms"], "overhead_with_vllm_p99_ms": over["p99_ms"],
        "prefix_hit_rate_sidecar": default["hit_rate"],
        "prefix_hit_rate_direct": hit["direct"]["hit_rate"],
        "tokens_sent_ratio": saving["ratio"], "import_tokens_per_s": imp["tokens_per_s"],
        "load_errors": ld["errors"], "turns_lost": lost,
        "import": imp, "baseline_seed": base, "baseline_seed_as_filed": filed,
        "overhead": alone, "overhead_with_vllm": over,
        "load": ld,
        "token_saving": saving, "prefix_hit_model": args.hit_model, "prefix": hit,
        "prefix_tiny_placements": tiny_runs, "wall_s": round(time.perf_counter() - t_start, 1)}
    print(f"\nimport: {imp['chunks']} chunks, {imp['tokens']} tokens in {imp['seconds']} s "
          f"({imp['tokens_per_s']} tokens/s); the seeding of before: {base['tokens_per_s']} "
          f"tokens/s with today's model precision ({base['dtype']}), {filed['tokens_per_s']} "
          f"as filed (float32); per chunk {imp['speedup_per_chunk']}x / "
          f"{imp['speedup_per_chunk_as_filed']}x faster")
    for what, o in (("null upstream (the sidecar alone)", alone),
                    ("vLLM on the same cores", over)):
        print(f"sidecar time per request, {what}, over {o['requests']} requests "
              f"({o['turns_per_conversation']}-turn conversations): p50 {o['p50_ms']} ms, "
              f"p99 {o['p99_ms']} ms; first turns (memory selected) p50 "
              f"{o['first_turn_p50_ms']} ms, p99 {o['first_turn_p99_ms']} ms")
        print(table([{"stage": s, "p50 ms": v["p50"], "p99 ms": v["p99"], "mean ms": v["mean"]}
                     for s, v in o["stages"].items()], ["stage", "p50 ms", "p99 ms", "mean ms"]))
    print(f"load: {ld['clients']} clients x {ld['turns']} turns in {ld['wall_s']} s, errors "
          f"{ld['errors']}, turns lost {lost}")
    for label, runs in (("tiny", tiny_runs), (args.hit_model, hit)):
        print(f"prefix cache, {label}, {len(talk)} turns (hit rate; turns with memory):")
        print(table([{"": k, "hit rate": v["hit_rate"], "memory turns": v["memory_turns"],
                      "prompt tokens": v["prompt_tokens"]} for k, v in runs.items()],
                    ["", "hit rate", "memory turns", "prompt tokens"]))
    ratio = (default["hit_rate"] or 0) / (hit["direct"]["hit_rate"] or math.inf)
    print(f"sidecar / direct hit rate ({args.hit_model}): {ratio:.3f}; token-saving mode: "
          f"{saving['ratio']} of a full replay; wall {result['wall_s']} s")
    write_json(args.json, result)
    return 0 if lost == 0 and ld["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
