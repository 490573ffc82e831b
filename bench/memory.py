"""Memory retrieval benchmark on LoCoMo-format conversations.

    python bench/memory.py --data /work/shared/data/locomo-dev --json out.json [--quick]

Every ``*.json`` file in ``--data`` holding a LoCoMo conversation (flat, as in locomo-dev, or a
``{"conversation": ..., "qa": ...}`` sample, or a list of samples as in locomo10.json) is
replayed into a fresh memory root: one tenant a conversation, one session a LoCoMo session,
each turn recorded with its ``dia_id`` as the turn id, its speaker as the role and the
session's date as the timestamp. Other files (README, ...) are skipped.

Replay simulates the sidecar: before each turn is recorded, ``select_context`` is asked for a
prompt within ``--budget`` tokens (the sidecar's default, 1024) given the session so far and
the new message; ``token_ratio`` = tokens sent (selection + new message) / tokens of the whole
history so far plus the new message, summed over all turns.

Then for every question (category 5 only when it names evidence; questions whose evidence ids
are not in the conversation are counted and skipped) and each mode (bm25, vector, hybrid):
recall = fraction of the evidence dia_ids contained in the retrieved chunks, for the top 5, 10
and 20 chunks, and for the best chunks that fit whole in 1k, 2k and 4k tokens.
Parameters are the library's defaults (chosen on principle, see cwm_plugin/memory/search.py);
nothing here is tuned to particular conversations.

What we saw on the three locomo-dev conversations (495 questions, MiniLM, cl100k; recall@10 /
recall@1k for bm25, vector, hybrid):

- chunks of 200/40 tokens: 0.813 0.759 0.862 / 0.766 0.666 0.807
- chunks of 400/80 (default): 0.881 0.815 0.900 / 0.747 0.578 0.767; token_ratio 0.098 at 1024
- chunks of 800/160: 0.909 0.871 0.921 / 0.649 0.484 0.660

Bigger chunks raise recall@k (a chunk holds more turns: ten 400-token chunks are about a sixth
of a LoCoMo conversation) and lower recall within a token budget. Hybrid beats each method at
every size, but by less than 5 points over BM25 at 400 tokens: LoCoMo questions reuse the
evidence's words (names, places), which is where BM25 is strong. Embedding each turn with the
turn before it lifted vector recall@10 from 0.747 to 0.815 (a reply often only makes sense with
the message it answers).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from cwm_plugin.memory.embeddings import CachedEmbedder, HashingEmbedder, MiniLMEmbedder
from cwm_plugin.memory.files import utc_iso
from cwm_plugin.memory.models import MemoryConfig, Turn
from cwm_plugin.memory.service import MemoryService
from cwm_plugin.memory.tokens import make_counter

MODES = ("bm25", "vector", "hybrid")
KS = (5, 10, 20)
BUDGETS = {"1k": 1000, "2k": 2000, "4k": 4000}


def load_conversations(folder: Path) -> list[tuple[str, dict, list[dict]]]:
    """``(name, conversation, qa)`` for every LoCoMo conversation found in ``folder``."""
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        samples = data if isinstance(data, list) else [data]
        for i, s in enumerate(samples):
            if not isinstance(s, dict) or "qa" not in s:
                continue
            conv = s.get("conversation", s)
            if not any(re.fullmatch(r"session_\d+", k) for k in conv):
                continue
            name = str(s.get("sample_id") or (path.stem if len(samples) == 1 else
                                              f"{path.stem}-{i}"))
            out.append((re.sub(r"[^A-Za-z0-9_.-]", "_", name), conv, s["qa"]))
    return out


def sessions(conv: dict) -> list[tuple[int, datetime | None, list[dict]]]:
    out = []
    for k, turns in conv.items():
        m = re.fullmatch(r"session_(\d+)", k)
        if m and isinstance(turns, list) and turns:
            out.append((int(m.group(1)), parse_date(conv.get(f"{k}_date_time")), turns))
    return sorted(out, key=lambda x: x[0])


def parse_date(s: object) -> datetime | None:
    for fmt in ("%I:%M %p on %d %B, %Y", "%I:%M %p on %d %b, %Y"):
        try:
            return datetime.strptime(str(s), fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None


def turn_text(t: dict) -> str:
    text = str(t.get("text", ""))
    if t.get("blip_caption"):
        text += f" [shares a photo: {t['blip_caption']}]"
    return text


def evidence_ids(q: dict) -> list[str]:
    ids: list[str] = []
    for e in q.get("evidence") or []:
        ids.extend(x for x in re.split(r"[;,\s]+", str(e)) if x)
    return list(dict.fromkeys(ids))


def replay(svc: MemoryService, tenant: str, conv: dict, budget: int | None,
           bar: tqdm) -> tuple[int, int]:
    """Record every turn as the sidecar would; returns (tokens sent, tokens of full history).

    With ``budget`` None the turns are appended to the files and the tenant is then rebuilt
    from them by ``reindex`` (batched embedding, much faster); no selection, both totals 0.
    """
    a = conv.get("speaker_a")
    counter = svc.counter
    sent = full = history_tokens = 0
    for num, when, turns in sessions(conv):
        session = f"session_{num}"
        msgs: list[dict] = []
        for t in turns:
            speaker = str(t.get("speaker", "user"))
            role = "user" if speaker == a else "assistant"
            content = turn_text(t)
            new = {"role": "user", "content": f"{speaker}: {content}"}
            new_cost = counter.count_messages([new])
            if budget is None:
                svc.files.append_turn(tenant, session, Turn(
                    str(t["dia_id"]), _role(speaker), content, utc_iso(when)))
                bar.update(1)
                continue
            if budget is not None:
                sel = svc.select_context(tenant, session, [*msgs, new], budget)
                sent += sel.tokens + new_cost
                full += history_tokens + new_cost
            svc.record_turn(tenant, session, _role(speaker), content, turn_id=str(t["dia_id"]),
                            ts=when)
            msgs.append({"role": role, "content": f"{speaker}: {content}"})
            history_tokens += new_cost
            bar.update(1)
    if budget is None:
        svc.reindex(tenant, progress=False)
    return sent, full


def _role(speaker: str) -> str:
    return re.sub(r"[^A-Za-z0-9 _.'-]", "_", speaker)[:64] or "user"


def recall(hits: list, evidence: set[str]) -> dict[str, float]:
    out = {}
    for k in KS:
        got = {tid for h in hits[:k] for tid in h.turn_ids}
        out[f"recall@{k}"] = len(got & evidence) / len(evidence)
    for name, budget in BUDGETS.items():
        used, got = 0, set()
        for h in hits:
            cost = h_tokens(h)
            if used + cost > budget:
                break
            used += cost
            got.update(h.turn_ids)
        out[f"recall@{name}"] = len(got & evidence) / len(evidence)
    return out


def h_tokens(hit) -> int:
    return int(hit.reasons.get("_tokens", 0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="first conversation, 60 questions")
    ap.add_argument("--budget", type=int, default=1024, help="select_context budget (tokens)")
    ap.add_argument("--tokenizer", default="tiktoken:cl100k_base")
    ap.add_argument("--embedder", choices=("local", "hashing"), default="local")
    ap.add_argument("--chunk-tokens", type=int, default=400)
    ap.add_argument("--chunk-overlap", type=int, default=80)
    ap.add_argument("--root", type=Path, help="memory root (default: a temporary folder)")
    ap.add_argument("--cache", type=Path, help="embedding cache folder to reuse across runs")
    ap.add_argument("--context-lines", type=int, default=1)
    ap.add_argument("--skip-sim", action="store_true",
                    help="record turns without simulating select_context (no token_ratio)")
    args = ap.parse_args(argv)

    convs = load_conversations(args.data)
    if not convs:
        print(f"no LoCoMo conversations in {args.data}", file=sys.stderr)
        return 2
    if args.quick:
        convs = convs[:1]
    counter = make_counter(args.tokenizer)
    embedder = MiniLMEmbedder() if args.embedder == "local" else HashingEmbedder()
    root = args.root or Path(tempfile.mkdtemp(prefix="cwm-bench-memory-"))
    cfg = MemoryConfig(root=root, chunk_tokens=args.chunk_tokens,
                       chunk_overlap=args.chunk_overlap, vector_context_lines=args.context_lines)
    if args.cache:
        embedder = CachedEmbedder(embedder, args.cache)
    svc = MemoryService(cfg, embedder, counter)

    t0 = time.perf_counter()
    sent = full = 0
    n_turns = sum(len(t) for _, c, _ in convs for _, _, t in sessions(c))
    with tqdm(total=n_turns, desc="replay", unit="turn") as bar:
        for name, conv, _ in convs:
            s, f = replay(svc, name, conv, None if args.skip_sim else args.budget, bar)
            sent += s
            full += f
    replay_s = time.perf_counter() - t0

    sums: dict[str, dict[str, float]] = {m: defaultdict(float) for m in MODES}
    by_cat: dict[str, list[float]] = defaultdict(list)
    asked = skipped = 0
    questions = [(name, q) for name, _, qa in convs for q in qa]
    if args.quick:
        questions = questions[:60]
    known = {name: {str(t["dia_id"]) for _, _, ts in sessions(conv) for t in ts}
             for name, conv, _ in convs}
    t1 = time.perf_counter()
    for name, q in tqdm(questions, desc="questions", unit="q"):
        ev = set(evidence_ids(q)) & known[name]
        if not ev:
            skipped += 1
            continue
        asked += 1
        idx = svc._index(name)
        for mode in MODES:
            hits = svc.search(name, str(q["question"]), 20, mode=mode)
            for h in hits:
                h.reasons["_tokens"] = idx.chunks[h.chunk_id].tokens
            for key, v in recall(hits, ev).items():
                sums[mode][key] += v
            if mode == "hybrid":
                by_cat[str(q.get("category"))].append(recall(hits, ev)["recall@10"])
    search_s = time.perf_counter() - t1

    result: dict = {m: {k: round(v / max(asked, 1), 4) for k, v in sums[m].items()}
                    for m in MODES}
    idx_stats = [svc._index(name) for name, _, _ in convs]
    chunks = [c for i in idx_stats for c in i.chunks.values()]
    result.update({
        "token_ratio": round(sent / full, 4) if full else None,
        "tokens_sent": sent, "tokens_full_history": full, "budget": args.budget,
        "questions": asked, "questions_skipped": skipped, "conversations": len(convs),
        "turns": n_turns, "chunks": len(chunks),
        "mean_chunk_tokens": round(sum(c.tokens for c in chunks) / max(len(chunks), 1), 1),
        "mean_turns_per_chunk": round(sum(len(c.turn_ids) for c in chunks)
                                      / max(len(chunks), 1), 1),
        "hybrid_recall@10_by_category": {c: round(sum(v) / len(v), 4)
                                         for c, v in sorted(by_cat.items())},
        "config": {"chunk_tokens": cfg.chunk_tokens, "chunk_overlap": cfg.chunk_overlap,
                   "bm25_weight": cfg.bm25_weight, "vector_weight": cfg.vector_weight,
                   "candidate_multiplier": cfg.candidate_multiplier,
                   "tokenizer": counter.name, "embedder": embedder.name},
        "seconds": {"replay": round(replay_s, 1), "questions": round(search_s, 1)},
    })
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    cols = ["recall@5", "recall@10", "recall@20", "recall@1k", "recall@2k", "recall@4k"]
    print(f"\n{asked} questions over {len(convs)} conversations, {len(chunks)} chunks "
          f"(mean {result['mean_chunk_tokens']} tokens, {result['mean_turns_per_chunk']} turns)")
    print(f"{'mode':8}" + "".join(f"{c:>11}" for c in cols))
    for m in MODES:
        print(f"{m:8}" + "".join(f"{result[m][c]:>11.3f}" for c in cols))
    if full:
        print(f"token_ratio {result['token_ratio']:.3f} (budget {args.budget}; {sent} sent / "
              f"{full} full history)")
    svc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
