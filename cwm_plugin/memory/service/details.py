"""What a running summary must keep, taken from the turns themselves: names, dates, decisions.

The running summary is written by the served model, and a small one loses what matters most
later (SmolLM2-135M wrote "Hi Maria, welcome to Lisbon! I'm your friendly AI assistant..." and
then one sentence over and over). So each summary update also keeps a short block computed
from the turns it covers, merged with the previous summary's block (progressive: every update
adds the new turns' details, bounded):

- **names**: the speakers (roles other than user/assistant/tool/system) and capitalised words
  that are not at the start of a sentence (or recur), commonest first;
- **dates**: each day the turns were said (their time stamps), explicit dates ("7 May 2023",
  "May 7", "2023-05-07"), and relative ones anchored to the day they were said ("yesterday
  (said 2023-05-08)"): cheap context for "when" questions;
- **decisions**: sentences with a decision or plan ("decided", "going to", "signed up",
  "plan to", ...), newest kept, with who said it.

The block is plain text under :data:`MARK` at the end of the summary, so it is read back from
the file and merged at the next update; a model echoing it is cut at the mark.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

MARK = "Kept from the conversation:"
MAX_NAMES, MAX_DATES, MAX_DECISIONS = 16, 12, 6
ROLES = {"user", "assistant", "tool", "system", "developer"}
_MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|"
           "December|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec")
_DATE = re.compile(
    rf"\b(?:\d{{1,2}}(?:st|nd|rd|th)? (?:{_MONTHS}),? \d{{4}}|(?:{_MONTHS}) \d{{1,2}}"
    rf"(?:st|nd|rd|th)?(?:,? \d{{4}})?|\d{{4}}-\d{{2}}-\d{{2}}|(?:{_MONTHS}) \d{{4}})\b")
_RELATIVE = re.compile(r"\b(?:yesterday|today|tomorrow|tonight|last (?:night|week|weekend|"
                       r"month|year|summer|winter|spring|fall)|next (?:week|weekend|month|"
                       r"year)|(?:a|one|two|three|few) (?:days?|weeks?|months?|years?) ago)\b",
                       re.IGNORECASE)
_DECISION = re.compile(r"\b(?:decided|decide to|going to|gonna|plan(?:ning)? to|signed up|"
                       r"chose|agreed|booked|enrolled|applied|promised|will start|quit)\b",
                       re.IGNORECASE)
_NOT_NAMES = set(["I", "I'm", "I've", "I'll", "I'd", "Hey", "Hi", "Hello", "Thanks", "Thank", "Wow", "Yes", "Yeah", "Yep", "No", "Oh", "OK", "Ok", "Okay", "Sure", "Great", "Awesome", "Cool", "Nice", "Sorry", "Well", "So", "And", "But", "The", "This", "That", "These", "Those", "It", "It's", "What", "When", "Where", "Why", "How", "Who", "Which", "My", "Your", "Our", "Their", "We", "You", "He", "She", "They", "Just", "Also", "Really", "Glad", "Good", "Congrats", "Congratulations", "Haha", "Lol", "Me", "Mine", "Here", "There", "Let", "Let's", "Can", "Could", "Would", "Should", "Will", "Did", "Do", "Does", "Have", "Has", "Had", "Is", "Are", "Was", "Were", "Be", "Been", "Being", "If", "Or", "As", "At", "In", "On", "Of", "For", "With", "By", "From", "To", "Not", "Anything", "Everything", "Something", "Nothing", "Everyone", "Someone", "Anyway", "Plus", "Btw", "Bye", "Totally", "Definitely", "Absolutely", "Maybe", "Still", "Even", "Now", "Then", "Today", "Tomorrow", "Yesterday", "Both", "All", "Any", "Some", "Every", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]) | set(_MONTHS.split("|"))
_CONTRACTION = re.compile(r"(?:n't|'re|'ll|'ve|'d|'m)$")


@dataclass
class Details:
    names: list[str] = field(default_factory=list)
    dates: list[str] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)

    def render(self) -> str:
        if not (self.names or self.dates or self.decisions):
            return ""
        out = [MARK]
        if self.names:
            out.append("- Names: " + ", ".join(self.names))
        if self.dates:
            out.append("- Dates: " + "; ".join(self.dates))
        out += [f"- Decision: {d}" for d in self.decisions]
        return "\n".join(out)

    def merge(self, newer: Details) -> Details:
        """These details with ``newer``'s added (bounded; the newest decisions kept)."""
        return Details(_union(self.names, newer.names)[:MAX_NAMES],
                       _union(self.dates, newer.dates)[-MAX_DATES:],
                       _union(self.decisions, newer.decisions)[-MAX_DECISIONS:])


def _union(a: list[str], b: list[str]) -> list[str]:
    return list(dict.fromkeys([*a, *b]))


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text) if s.strip()]


def extract(turns: list[dict[str, Any]]) -> Details:
    """The details of transcript turns (``role``, ``content``, ``ts``)."""
    counts: Counter[str] = Counter()
    starts: Counter[str] = Counter()
    speakers: list[str] = []
    dates: list[str] = []
    decisions: list[str] = []
    for t in turns:
        role, text, day = str(t.get("role", "")), str(t.get("content", "")), \
            str(t.get("ts", ""))[:10]
        if role and role.lower() not in ROLES and role not in speakers:
            speakers.append(role)
        if day:
            dates.append(day)
        for sentence in _sentences(text):
            words = [w.removesuffix("'s") for w in re.findall(r"[A-Za-z][A-Za-z'-]*", sentence)
                     if not _CONTRACTION.search(w)]
            for i, w in enumerate(words):
                if w[0].isupper() and w not in _NOT_NAMES and len(w) > 1:
                    (starts if i == 0 else counts)[w] += 1
            if _DECISION.search(sentence) and len(sentence.split()) <= 30:
                decisions.append(f"{role}: {sentence}" if role else sentence)
        dates += _DATE.findall(text)
        dates += [f"{m.lower()} (said {day})" if day else m.lower()
                  for m in _RELATIVE.findall(text)]
    for w, n in starts.items():  # a capitalised first word is a name if it recurs
        if w in counts or n >= 2:
            counts[w] += n
    names = [w for w, _ in counts.most_common() if w not in speakers]
    return Details(speakers + names[:MAX_NAMES - len(speakers)], _union(dates, [])[:MAX_DATES],
                   decisions[-MAX_DECISIONS:])


def parse(summary: str | None) -> tuple[str, Details]:
    """``(the prose, its details)`` of a stored summary."""
    if not summary:
        return "", Details()
    prose, _, block = summary.partition(MARK)
    got = Details()
    for line in block.splitlines():
        line = line.strip()
        if line.startswith("- Names: "):
            got.names = [x.strip() for x in line[9:].split(",") if x.strip()]
        elif line.startswith("- Dates: "):
            got.dates = [x.strip() for x in line[9:].split(";") if x.strip()]
        elif line.startswith("- Decision: "):
            got.decisions.append(line[12:])
    return prose.strip(), got


def with_details(model_text: str, previous: str | None, turns: list[dict[str, Any]]) -> str:
    """The summary to store: the model's text (cut at an echoed block) and the previous
    summary's details merged with those of ``turns`` (the turns this update covers)."""
    prose = model_text.partition(MARK)[0].strip()
    block = parse(previous)[1].merge(extract(turns)).render()
    return f"{prose}\n\n{block}" if block else prose
