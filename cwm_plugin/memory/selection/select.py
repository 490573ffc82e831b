"""Selection under a token budget: recent turns verbatim, then facts, summary and memory hits.

Order of priority (each item is kept only if everything kept so far plus it still fits):

1. the last ``recent_turns`` history messages, newest group first (``history.py``: a tool call
   stays with its results), then older system/developer messages (pinned instructions);
2. durable memories in the order hybrid search ranked them (``search.py``), at most
   ``max_facts``;
3. the session's running summary;
4. retrieved conversation: by default the best *lines* packed into passages (``pack.py``, lines
   ranked by ``lines.py``); with ``retrieval_unit: chunk``, whole chunks in score order (a
   chunk that does not fit whole is trimmed to the lines nearest its best-matching line before
   it is given up). Turns the prompt carries anyway are skipped.
 Costs are added up from the counted pieces (each line, fact, header and
separator, counted once and cached), which is cheap even when counting means asking vLLM's
``/tokenize``; the assembled block is then counted exactly with the same ``TokenCounter`` and,
should joining pieces have cost more than their sum, the last items are dropped until it fits,
so ``Selection.tokens <= budget`` always holds. The sum is an upper estimate (a newline after
punctuation shares its token), so lines are packed again with the room the assembled block
left unused: a block comes close to its budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cwm_plugin.memory.models import Hit, Memory, Selection
from cwm_plugin.memory.selection.history import window
from cwm_plugin.memory.selection.lines import Line
from cwm_plugin.memory.selection.pack import Packed, pack_lines
from cwm_plugin.memory.tokens import TokenCounter, content_text

FACTS_HEADER = "Known facts about the user:"
SUMMARY_HEADER = "Summary of this conversation so far:"
HITS_HEADER = "Relevant earlier conversation:"
JOIN_MARGIN = 1  # tokens allowed for each separator ("\n" or "\n\n") between pieces
FILL_ROUNDS = 2  # packings again with the room the estimate left unused
FILL_MIN = 8  # tokens unused below which the lines are not packed again


@dataclass
class Candidates:
    facts: list[Memory]
    fact_hits: list[Hit]  # the memories' search hits, same order (scores and reasons)
    summary: str | None
    hits: list[Hit]
    hit_line_scores: list[np.ndarray | None]  # per hit: similarity of each line, or None
    lines: list[Line] | None = None  # ranked lines: packed instead of the chunks
    rows_of: Callable[[str], list] | None = None  # a session's units (for neighbours)
    neighbours: int = 0

    @property
    def line_tokens(self) -> dict[str, int]:
        """Each ranked line's token count, as the index counted it (``Unit.tokens``)."""
        return {ln.unit.text: ln.unit.tokens for ln in self.lines or () if ln.unit.tokens > 0}


def fact_line(m: Memory) -> str:
    return f"- ({m.category}) {m.text}"


def render(facts: list[Memory], summary: str | None, hits: list[tuple[Hit, str]]) -> str:
    parts = []
    if facts:
        parts.append("\n".join([FACTS_HEADER, *(fact_line(m) for m in facts)]))
    if summary:
        parts.append(f"{SUMMARY_HEADER}\n{summary.strip()}")
    if hits:
        parts.append("\n\n".join([HITS_HEADER, *(text for _, text in hits)]))
    return "\n\n".join(parts)


class _Pieces:
    """Token counts of pieces of text, each counted once. ``known``: lines' counts made when
    the index was built, taken times ``scale`` (1: the same tokenizer as this counter's; else
    the ratio of the two, ``ratios.py``) instead of counting the line."""

    def __init__(self, counter: TokenCounter, known: dict[str, int] | None = None,
                 scale: float = 1.0) -> None:
        self.counter = counter
        self._known = known or {}
        self._scale = scale
        self._cache: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        n = self._cache.get(text)
        if n is None:
            k = self._known.get(text)
            if k is None:
                n = self.counter.count(text)
            else:
                n = k if self._scale == 1.0 else math.ceil(k * self._scale)
            self._cache[text] = n
        return n

    def lines(self, lines: list[str]) -> int:
        return sum(self(x) for x in lines) + JOIN_MARGIN * max(0, len(lines) - 1)


def _estimate(p: _Pieces, facts: list[Memory], summary: str | None,
              hits: list[tuple[Hit, str]]) -> int:
    """An upper estimate of ``count(render(...))`` from the pieces' counts."""
    parts = []
    if facts:
        parts.append(p.lines([FACTS_HEADER, *(fact_line(m) for m in facts)]))
    if summary:
        parts.append(p.lines([SUMMARY_HEADER, summary.strip()]))
    if hits:
        parts.append(p(HITS_HEADER) + sum(p.lines(t.split("\n")) + JOIN_MARGIN for _, t in hits))
    return sum(parts) + JOIN_MARGIN * max(0, len(parts) - 1)


def _trim(hit: Hit, line_scores: np.ndarray | None, p: _Pieces, room: int) -> str | None:
    """The widest window of the chunk's lines around its best line costing <= ``room``."""
    lines = hit.text.split("\n")
    header, body = lines[0], lines[1:]
    if not body:
        return None
    best = int(np.argmax(line_scores)) if line_scores is not None and \
        len(line_scores) == len(body) else len(body) // 2
    lo, hi = best, best + 1

    def cost(a: int, b: int) -> int:
        return p.lines([header, *body[a:b]]) + JOIN_MARGIN

    if cost(lo, hi) > room:
        return None
    while True:
        grown = False
        for nlo, nhi in ((lo - 1, hi), (lo, hi + 1)):
            if nlo >= 0 and nhi <= len(body) and cost(nlo, nhi) <= room:
                lo, hi, grown = nlo, nhi, True
        if not grown:
            return "\n".join([header, *body[lo:hi]])


def _recent(counter: TokenCounter, history: list[dict], n: int, budget: int,
            reasons: list[str]) -> tuple[list[dict], int]:
    groups, pinned = window(history, n)
    kept: list[list[dict]] = []
    used = 0
    for i in range(len(groups) - 1, -1, -1):
        g = groups[i]
        cost = counter.count_messages(g)
        what = "/".join(str(m.get("role")) for m in g)
        if used + cost > budget:
            reasons.append(f"drop recent {what} turn ({cost} tokens): over budget")
            if i:
                reasons.append(f"drop {i} older recent turns: over budget")
            break
        kept.insert(0, g)
        used += cost
        reasons.append(f"keep recent {what} turn ({cost} tokens)")
    pins: list[dict] = []
    for m in pinned:
        cost = counter.count_messages([m])
        if used + cost <= budget:
            pins.append(m)
            used += cost
            reasons.append(f"keep pinned {m.get('role')} message ({cost} tokens)")
        else:
            reasons.append(f"drop pinned {m.get('role')} message ({cost} tokens): over budget")
    return pins + [m for g in kept for m in g], used


def select(counter: TokenCounter, history: list[dict], recent_turns: int, budget: int,
           cands: Candidates, recent_turn_ids: set[str] | None = None,
           max_facts: int = 8, present: list[dict] | tuple = (),
           known: dict[str, int] | None = None, scale: float = 1.0) -> Selection:
    """``present``: messages the prompt carries anyway (the current exchange): chunks made
    only of their text are skipped like recent ones. ``known``: token counts of lines made
    when the index was built, times ``scale`` in ``counter``'s tokens (1 when it is the
    index's tokenizer): not counted again (counting a first turn's hundreds of candidate
    lines would be a large part of the selection, more so with a model's tokenizer)."""
    reasons: list[str] = []
    known = known or {}
    prefetch = getattr(counter, "count_many", None)
    if prefetch is not None:  # every piece this selection may count, in one batch
        chunk_lines = [ln for h in cands.hits for ln in h.text.split("\n")] \
            if cands.lines is None else []  # packed lines are counted as units, not chunks
        prefetch([FACTS_HEADER, SUMMARY_HEADER, HITS_HEADER, *(fact_line(m) for m in cands.facts),
                  *chunk_lines, *(ln.unit.text for ln in (cands.lines or [])[:200]
                                  if ln.unit.text not in known)])
    recent, used = _recent(counter, history, recent_turns, budget, reasons)
    recent_text = {" ".join(content_text(m).split()) for m in [*recent, *present]}
    recent_ids = recent_turn_ids or set()
    p = _Pieces(counter, known, scale)
    room = budget - used
    facts: list[Memory] = []
    summary: str | None = None
    kept: list[tuple[Hit, str]] = []

    for m, h in list(zip(cands.facts, cands.fact_hits, strict=True))[:max(0, max_facts)]:
        if _estimate(p, [*facts, m], summary, kept) <= room:
            facts.append(m)
            reasons.append(f"keep memory {m.id} ({m.category}, score {h.score:.3f})")
        else:
            reasons.append(f"drop memory {m.id}: over budget")
    if cands.summary:
        if _estimate(p, facts, cands.summary, kept) <= room:
            summary = cands.summary
            reasons.append("keep session summary")
        else:
            reasons.append("drop session summary: over budget")
    packed: Packed | None = None
    if cands.lines is not None:
        left = room - _estimate(p, facts, summary, kept) - p(HITS_HEADER) - 2 * JOIN_MARGIN
        packed = _pack_filled(counter, p, cands, left, room, facts, summary, recent_ids,
                              recent_text)
        reasons.extend(packed.reasons)
        kept = [(h, h.text) for h in packed.hits()]
    else:
        _take_chunks(cands, p, room, facts, summary, kept, recent_ids, recent_text, reasons)
    block = render(facts, summary, kept)
    while block and (n := counter.count(block)) > room:  # the pieces cost more once joined
        if packed is not None and packed.taken:
            reasons.extend(_shrink(packed, p, n - room, n / max(1, _estimate(p, facts, summary,
                                                                              kept))))
            kept = [(h, h.text) for h in packed.hits()]
        elif kept and packed is None:
            h, _ = kept.pop()
            reasons.append(f"drop chunk {h.chunk_id[:12]}: over budget once assembled")
        elif summary:
            summary = None
            reasons.append("drop session summary: over budget once assembled")
        elif facts:
            m = facts.pop()
            reasons.append(f"drop memory {m.id}: over budget once assembled")
        else:
            kept = []
        block = render(facts, summary, kept)
    tokens = (counter.count(block) if block else 0) + counter.count_messages(recent)
    return Selection(recent=recent, memory_block=block, hits=[h for h, _ in kept],
                     summary=summary, facts=facts, tokens=tokens, reasons=reasons,
                     fact_hits=[h for m, h in zip(cands.facts, cands.fact_hits, strict=True)
                                if m in facts])


def _pack_filled(counter: TokenCounter, p: _Pieces, cands: Candidates, left: int, room: int,
                 facts: list[Memory], summary: str | None, recent_ids: set[str],
                 recent_text: set[str]) -> Packed:
    """The best lines packed into ``left`` tokens; then, since the packer's cost is an upper
    estimate (a newline after punctuation is no token of its own), packed again with what the
    assembled block left unused added, up to ``FILL_ROUNDS`` times."""
    seen: dict[tuple[str, int], bool] = {}  # each line judged once for every round

    def skip(ln: Line) -> bool:
        got = seen.get((ln.session, ln.row))
        if got is None:
            got = seen[ln.session, ln.row] = ln.unit.turn_id in recent_ids or " ".join(
                ln.unit.text.split(": ", 1)[-1].split()) in recent_text
        return got

    def run(r: int) -> Packed:
        return pack_lines(cands.lines or [], cands.rows_of or (lambda s: []), r, p,
                    neighbours=cands.neighbours, skip=skip)

    packed = run(left)
    for _ in range(FILL_ROUNDS):
        kept = [(h, h.text) for h in packed.hits()]
        n = counter.count(render(facts, summary, kept))
        if room - n < FILL_MIN or len(packed.taken) >= len(cands.lines or []):
            break
        # the room left, in the estimate's tokens (they ran n / estimate of the real ones)
        left += int((room - n) * _estimate(p, facts, summary, kept) / max(1, n))
        packed = run(left)
    return packed


def _shrink(packed: Packed, p: _Pieces, over: int, ratio: float) -> list[str]:
    """Give back the lines taken last until their estimated cost, times ``ratio`` (real tokens
    per estimated one in this block), covers the ``over`` tokens the block has too many: one
    exact count of the block after, not one after each line dropped (a count with a model's
    tokenizer is not cheap)."""
    reasons: list[str] = []
    freed = 0.0
    while packed.taken and freed < over:
        freed += (p(packed.last_text()) + JOIN_MARGIN) * ratio
        reasons.append(packed.drop_last())
    return reasons


def _take_chunks(cands: Candidates, p: _Pieces, room: int, facts: list[Memory],
                 summary: str | None, kept: list[tuple[Hit, str]], recent_ids: set[str],
                 recent_text: set[str], reasons: list[str]) -> None:
    """Whole chunks in score order (``retrieval_unit: chunk``), the last one trimmed."""
    for hit, line_scores in zip(cands.hits, cands.hit_line_scores, strict=True):
        short = hit.chunk_id[:12]
        body = [ln.split(": ", 1)[-1] for ln in hit.text.split("\n")[1:]]
        if (hit.turn_ids and recent_ids.issuperset(hit.turn_ids)) or \
                (body and all(" ".join(b.split()) in recent_text for b in body)):
            reasons.append(f"skip chunk {short}: its turns are all recent")
            continue
        if _estimate(p, facts, summary, [*kept, (hit, hit.text)]) <= room:
            kept.append((hit, hit.text))
            reasons.append(f"keep chunk {short} ({hit.source}, score {hit.score:.3f})")
            continue
        left = room - _estimate(p, facts, summary, kept) - (0 if kept else p(HITS_HEADER)
                                                            + JOIN_MARGIN)
        part = _trim(hit, line_scores, p, left)
        if part is not None:
            kept.append((hit, part))
            reasons.append(f"keep part of chunk {short} ({hit.source}, score {hit.score:.3f})")
        else:
            reasons.append(f"drop chunk {short} (score {hit.score:.3f}): over budget")
