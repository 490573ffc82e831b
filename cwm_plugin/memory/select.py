"""Selection under a token budget: recent turns verbatim, then facts, summary and memory hits.

Order of priority (each item is kept only if everything kept so far plus it still fits):

1. the last ``recent_turns`` turns, newest first (the model needs the thread of the talk);
2. durable facts, best first by ``0.5 * importance + 0.5 * cosine(query, fact)``, at most 8;
3. the session's running summary;
4. retrieved chunks in score order, skipping those whose turns are all among the recent ones.

A chunk that does not fit whole is trimmed to the lines nearest its best-matching line before
it is given up. The budget is checked by counting the *assembled* text with the same
``TokenCounter`` the caller uses, so ``Selection.tokens <= budget`` always holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cwm_plugin.memory.models import Hit, Memory, Selection
from cwm_plugin.memory.tokens import TokenCounter

FACTS_HEADER = "Known facts about the user:"
SUMMARY_HEADER = "Summary of this conversation so far:"
HITS_HEADER = "Relevant earlier conversation:"
MAX_FACTS = 8


@dataclass
class Candidates:
    facts: list[Memory]
    fact_scores: list[float]
    summary: str | None
    hits: list[Hit]
    hit_line_scores: list[np.ndarray | None]  # per hit: similarity of each line, or None


def render(facts: list[Memory], summary: str | None, hits: list[tuple[Hit, str]]) -> str:
    parts = []
    if facts:
        parts.append("\n".join([FACTS_HEADER, *(f"- ({m.category}) {m.text}" for m in facts)]))
    if summary:
        parts.append(f"{SUMMARY_HEADER}\n{summary.strip()}")
    if hits:
        parts.append("\n\n".join([HITS_HEADER, *(text for _, text in hits)]))
    return "\n\n".join(parts)


def _trim(hit: Hit, line_scores: np.ndarray | None, fits: Callable[[str], bool]) -> str | None:
    """The widest window of the chunk's lines around its best line that fits, or None."""
    lines = hit.text.split("\n")
    header, body = lines[0], lines[1:]
    if not body:
        return None
    if line_scores is not None and len(line_scores) == len(body):
        best = int(np.argmax(line_scores))
    else:
        best = len(body) // 2
    lo, hi = best, best + 1
    if not fits("\n".join([header, *body[lo:hi]])):
        return None
    while True:
        grown = False
        for nlo, nhi in ((lo - 1, hi), (lo, hi + 1)):
            if nlo >= 0 and nhi <= len(body) and fits("\n".join([header, *body[nlo:nhi]])):
                lo, hi, grown = nlo, nhi, True
        if not grown:
            return "\n".join([header, *body[lo:hi]])


def select(counter: TokenCounter, history: list[dict], recent_turns: int, budget: int,
           cands: Candidates, recent_turn_ids: set[str] | None = None) -> Selection:
    reasons: list[str] = []
    recent: list[dict] = []
    used = 0
    for m in reversed(history[-recent_turns:] if recent_turns else []):
        cost = counter.count_messages([m])
        if used + cost <= budget:
            recent.insert(0, m)
            used += cost
            reasons.append(f"keep recent {m.get('role')} turn ({cost} tokens)")
        else:
            reasons.append(f"drop recent {m.get('role')} turn ({cost} tokens): over budget")
            break
    dropped_older = len(history[-recent_turns:] if recent_turns else []) - len(recent)
    if dropped_older > 1:
        reasons.append(f"drop {dropped_older - 1} older recent turns: over budget")
    recent_text = {" ".join(str(m.get("content", "")).split()) for m in recent}
    recent_ids = recent_turn_ids or set()

    facts: list[Memory] = []
    summary: str | None = None
    kept: list[tuple[Hit, str]] = []

    def fits_with(f: list[Memory], s: str | None, h: list[tuple[Hit, str]]) -> bool:
        return used + counter.count(render(f, s, h)) <= budget

    order = sorted(range(len(cands.facts)), key=lambda i: -cands.fact_scores[i])[:MAX_FACTS]
    for i in order:
        m = cands.facts[i]
        if fits_with([*facts, m], summary, kept):
            facts.append(m)
            reasons.append(f"keep fact {m.id} ({m.category}, score {cands.fact_scores[i]:.2f})")
        else:
            reasons.append(f"drop fact {m.id}: over budget")
    if cands.summary:
        if fits_with(facts, cands.summary, kept):
            summary = cands.summary
            reasons.append("keep session summary")
        else:
            reasons.append("drop session summary: over budget")
    for hit, line_scores in zip(cands.hits, cands.hit_line_scores, strict=True):
        short = hit.chunk_id[:12]
        if hit.turn_ids and recent_ids.issuperset(hit.turn_ids):
            reasons.append(f"skip chunk {short}: its turns are all recent")
            continue
        body = [ln.split(": ", 1)[-1] for ln in hit.text.split("\n")[1:]]
        if body and all(" ".join(b.split()) in recent_text for b in body):
            reasons.append(f"skip chunk {short}: its turns are all recent")
            continue
        if fits_with(facts, summary, [*kept, (hit, hit.text)]):
            kept.append((hit, hit.text))
            reasons.append(f"keep chunk {short} ({hit.source}, score {hit.score:.3f})")
            continue
        part = _trim(hit, line_scores, lambda t, h=hit: fits_with(facts, summary,
                                                                    [*kept, (h, t)]))
        if part is not None:
            kept.append((hit, part))
            reasons.append(f"keep part of chunk {short} ({hit.source}, score {hit.score:.3f})")
        else:
            reasons.append(f"drop chunk {short} (score {hit.score:.3f}): over budget")
    block = render(facts, summary, kept)
    tokens = (counter.count(block) if block else 0) + counter.count_messages(recent)
    return Selection(recent=recent, memory_block=block, hits=[h for h, _ in kept],
                     summary=summary, facts=facts, tokens=tokens, reasons=reasons)
