"""Budget-aware packing of ranked lines into passages (retrieval at turn granularity).

The best lines (``lines.py``) are taken in score order while the block still fits the room
left: a line joins the passage of its session and day (one header ``[session S, YYYY-MM-DD]``
a passage, so a date is always in sight for "when" questions); lines of one passage stay in
conversation order, and a gap between two runs of lines is shown as ``…``. With
``neighbours`` > 0 each line brings the lines around it (the question before an answer), or
comes alone when they do not fit. Lines the prompt carries anyway (recent turns, the current
exchange) are skipped. Costs are summed from counted pieces (each line and header counted once
with the budget's counter); the caller counts the assembled block exactly and drops the last
lines taken should joining have cost more.

Lines packed put more evidence within a budget than whole chunks, and more than lines with one
neighbour each side (a hit then costs three lines), so ``neighbours`` is 0 by default
(``bench/memory_retrieval.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cwm_plugin.memory.index.chunking import chunk_id
from cwm_plugin.memory.models import Hit
from cwm_plugin.memory.selection.lines import Line

GAP = "…"
MAX_LINES_SCANNED = 400


@dataclass
class Passage:
    """Lines of one session and day, in conversation order."""

    session: str
    day: str
    lines: dict[int, Line] = field(default_factory=dict)  # row -> line

    @property
    def header(self) -> str:
        return f"[session {self.session}, {self.day}]"

    def text(self) -> str:
        out, prev = [self.header], None
        for row in sorted(self.lines):
            if prev is not None and row != prev + 1:
                out.append(GAP)
            out.append(self.lines[row].unit.text)
            prev = row
        return "\n".join(out)

    def cost(self, count: Callable[[str], int]) -> int:
        """An upper estimate of ``count(self.text())`` (one token a newline)."""
        rows = sorted(self.lines)
        gaps = sum(1 for a, b in zip(rows, rows[1:], strict=False) if b != a + 1)
        return count(self.header) + sum(count(self.lines[r].unit.text) + 1 for r in rows) \
            + 2 * gaps

    def hit(self) -> Hit:
        text = self.text()
        rows = sorted(self.lines)
        ids = list(dict.fromkeys(self.lines[r].unit.turn_id for r in rows))
        best = max(self.lines.values(), key=lambda ln: ln.score)
        return Hit(text=text, score=best.score, source=f"session:{self.session}",
                   chunk_id=chunk_id(self.session, text), turn_ids=ids,
                   reasons={**best.reasons, "lines": float(len(rows))})


@dataclass
class Packed:
    passages: list[Passage]
    taken: list[tuple[str, int]]  # (session, row) in the order taken
    reasons: list[str]

    def hits(self) -> list[Hit]:
        """One hit a passage, in time order (oldest first)."""
        ordered = sorted((p for p in self.passages if p.lines),
                         key=lambda p: (p.day, p.session, min(p.lines)))
        return [p.hit() for p in ordered]

    def _holding(self, session: str, row: int) -> Passage | None:
        return next((p for p in self.passages if p.session == session and row in p.lines), None)

    def last_text(self) -> str:
        """The text of the line taken last ("" when none is)."""
        p = self._holding(*self.taken[-1]) if self.taken else None
        return p.lines[self.taken[-1][1]].unit.text if p is not None else ""

    def drop_last(self) -> str:
        """Give back the line taken last; returns a reason."""
        session, row = self.taken.pop()
        p = self._holding(session, row)
        if p is None:
            return "drop a turn: over budget once assembled"
        return f"drop turn {p.lines.pop(row).unit.turn_id}: over budget once assembled"


def pack_lines(lines: list[Line], rows_of: Callable[[str], list], room: int,
         count: Callable[[str], int], *, neighbours: int = 0,
         skip: Callable[[Line], bool] = lambda ln: False) -> Packed:
    """Take ``lines`` (best first) into passages while their estimated cost fits ``room``.
    ``rows_of(session)`` gives the session's units (for neighbours); ``count`` counts a piece
    of text; ``skip`` says which lines the prompt has anyway."""
    passages: dict[tuple[str, str], Passage] = {}
    taken: list[tuple[str, int]] = []
    reasons: list[str] = []
    used = 0
    scan = lines[:MAX_LINES_SCANNED]
    floor = [0] * (len(scan) + 1)  # floor[i]: the least any line from i on can cost (a line
    floor[-1] = room + 1           # filling the gap between two taken rows saves a gap mark)
    for i in range(len(scan) - 1, -1, -1):
        floor[i] = min(floor[i + 1], count(scan[i].unit.text) + 1 - 2)
    for i, line in enumerate(scan):
        if room - used < floor[i]:
            if used < room:
                reasons.append(f"stop: {room - used} tokens left, less than any line left costs")
            break
        if skip(line):
            reasons.append(f"skip turn {line.unit.turn_id}: in the prompt already")
            continue
        group = [line]
        if neighbours:
            units = rows_of(line.session)
            for r in range(max(0, line.row - neighbours),
                           min(len(units), line.row + neighbours + 1)):
                if r != line.row:
                    group.append(Line(line.session, r, units[r], line.score, {"neighbour": 1}))
            group = [g for g in group if not skip(g)]
        for attempt in (group, [line]) if len(group) > 1 else ([line],):
            extra = _extra_cost(passages, attempt, count)
            if extra is None:
                reasons.append(f"skip turn {line.unit.turn_id}: taken already")
                break
            if used + extra <= room:
                for g in attempt:
                    p = passages.setdefault((g.session, g.unit.ts[:10]),
                                            Passage(g.session, g.unit.ts[:10]))
                    if g.row not in p.lines:
                        p.lines[g.row] = g
                        taken.append((g.session, g.row))
                used += extra
                reasons.append(f"keep turn {line.unit.turn_id} (session:{line.session}, "
                               f"score {line.score:.3f})")
                break
        else:
            reasons.append(f"drop turn {line.unit.turn_id} (score {line.score:.3f}): "
                           "over budget")
    return Packed(list(passages.values()), taken, reasons)


def _extra_cost(passages: dict[tuple[str, str], Passage], group: list[Line],
                count: Callable[[str], int]) -> int | None:
    """What adding ``group`` costs (a new passage adds its header and a blank line); None
    when every line of it is taken already."""
    if len(group) == 1:
        return _line_cost(passages, group[0], count)
    touched: dict[tuple[str, str], Passage] = {}
    new = False
    for g in group:
        key = (g.session, g.unit.ts[:10])
        p = passages.get(key)
        if p is not None and g.row in p.lines:
            continue
        new = True
        if key not in touched:
            touched[key] = Passage(g.session, key[1], dict(p.lines) if p else {})
        touched[key].lines[g.row] = g
    if not new:
        return None
    extra = 0
    for key, after in touched.items():
        before = passages.get(key)  # a new passage also costs the blank line before it
        extra += after.cost(count) - (before.cost(count) if before else -2)
    return extra


def _line_cost(passages: dict[tuple[str, str], Passage], g: Line,
               count: Callable[[str], int]) -> int | None:
    """``_extra_cost`` of one line, from its neighbours in its passage alone (``Passage.cost``
    of the passage with and without it, without copying or re-counting the passage: a
    selection weighs hundreds of lines, up to three times)."""
    key = (g.session, g.unit.ts[:10])
    p = passages.get(key)
    own = count(g.unit.text) + 1
    if p is None:
        return count(Passage(g.session, key[1]).header) + own + 2
    if g.row in p.lines:
        return None
    before = max((r for r in p.lines if r < g.row), default=None)
    after = min((r for r in p.lines if r > g.row), default=None)
    gaps = (before is not None and g.row != before + 1) + (after is not None
                                                           and after != g.row + 1)
    if before is not None and after is not None:
        gaps -= 1  # the gap between them (there was one: this row lies between)
    return own + 2 * gaps
