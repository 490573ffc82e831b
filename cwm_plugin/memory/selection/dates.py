"""Explicit dates a query names, and how near a line's time stamp is to them.

"What did Maria share on 16 June, 2023?", "... in August 2023?", "When did she go camping in
June?": a question that names a day or a month asks about what was said then, and every line
carries the time stamp of its turn (an imported conversation: its session's date). The words
"June" or "16" rarely appear in the line itself, so neither BM25 nor the embedding sees the
match; ``lines.py`` adds ``date_weight`` times :func:`nearness` to a line's score instead.

Only explicit dates are read: a day with its month (``16 June``, ``June 16``, with or without
a year, or ISO ``2023-06-16``), or a month with a year (``August 2023``) or after ``in`` /
``during`` / ``since`` (``in June``). A bare year, or "May" with neither (a modal verb), is no
date. Relative ones ("last week") would need to know when the question is asked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, timedelta

MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august",
          "september", "october", "november", "december")
_M = "|".join(MONTHS)
_DAY = r"(\d{1,2})(?:st|nd|rd|th)?"
_YEAR = r"(?:,?\s+((?:19|20)\d\d))"
_PATTERNS = (  # (regex, group of the day, of the month, of the year)
    (re.compile(r"\b((?:19|20)\d\d)-(\d\d)-(\d\d)\b"), 3, 2, 1),
    (re.compile(rf"\b{_DAY}(?:\s+of)?\s+({_M})\b{_YEAR}?", re.I), 1, 2, 3),
    (re.compile(rf"\b({_M})\s+{_DAY}\b{_YEAR}?", re.I), 2, 1, 3),
    (re.compile(rf"\b({_M}){_YEAR}", re.I), None, 1, 2),
    (re.compile(rf"\b(?:in|during|since|of|early|late|mid)\s+({_M})\b", re.I), None, 1, None),
)
FALLOFF_DAYS = 7  # nearness falls from 1 inside the period to 0 a week away


@dataclass(frozen=True)
class Period:
    """A day (``day`` set) or a month; ``year`` None: that day or month of any year."""

    month: int
    day: int | None = None
    year: int | None = None

    def distance(self, when: date) -> int:
        """Days from ``when`` to this period (0 inside it)."""
        year = self.year if self.year is not None else when.year
        if self.day is not None:
            try:
                first = last = date(year, self.month, self.day)
            except ValueError:  # 29 February of a year without one
                first = last = date(year, self.month, self.day - 1)
        else:
            first = date(year, self.month, 1)
            nxt = date(year + self.month // 12, self.month % 12 + 1, 1)
            last = nxt - timedelta(days=1)
        if first <= when <= last:
            return 0
        return (first - when).days if when < first else (when - last).days


def periods(query: str) -> list[Period]:
    """The days and months ``query`` names explicitly (see the module docstring)."""
    out: list[Period] = []
    taken: list[tuple[int, int]] = []
    for rx, gd, gm, gy in _PATTERNS:
        for m in rx.finditer(query):
            if any(a < m.end() and m.start() < b for a, b in taken):
                continue  # part of a date read already ("16 June, 2023" is no "June 2023")
            month = m.group(gm)
            month_n = int(month) if month.isdigit() else MONTHS.index(month.lower()) + 1
            day = int(m.group(gd)) if gd else None
            year = int(m.group(gy)) if gy and m.group(gy) else None
            try:  # (a year without 29 February is read as no date)
                date(year or 2000, month_n, day or 1)
            except ValueError:
                continue
            taken.append((m.start(), m.end()))
            out.append(Period(month_n, day, year))
    return out


def nearness(found: list[Period], ts: str) -> float:
    """1 when the ISO time stamp ``ts`` falls in one of the periods, falling linearly to 0
    ``FALLOFF_DAYS`` away; 0 without periods or a readable time stamp."""
    if not found:
        return 0.0
    try:
        when = date.fromisoformat(ts[:10])
    except ValueError:
        return 0.0
    d = min(p.distance(when) for p in found)
    return max(0.0, 1.0 - d / FALLOFF_DAYS)
