"""Multi-session conversations with planted facts, generated: seeded, deterministic, offline.

The project's own conversation text, used by the demo, the tests, the benchmarks and as the test
model's tokenizer corpus. Each conversation is two people (a relative sometimes drops in to say
hello) talking over dated sessions, a few days to weeks apart: greetings, small talk, news that
plants facts (a pet adopted, a race signed up for, a book read; see
:mod:`cwm_plugin.testing.conversations.topics`) and, in later sessions, follow-ups that refer back
to them (the race was run, the pet learned a trick).

It comes in LoCoMo's layout (:class:`cwm_plugin.testing.conversations.locomo.Conversation`):
``session_N`` turns ``{speaker, dia_id, text}``, ``session_N_date_time`` ("1:56 pm on 8 May, 2023"),
``session_N_summary``, ``speaker_a``/``speaker_b``, and ``qa`` entries with ``question``,
``answer``, ``evidence`` (the dia_ids of the turns that hold the answer) and ``category`` (1
multi-hop: a fact and its follow-up; 2 temporal; 4 single-hop), so whatever reads LoCoMo reads it.
Only ``random.Random(seed)`` decides (no set order, no locale), so a seed gives the same text on
every machine.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from cwm_plugin.testing.conversations import phrasebook
from cwm_plugin.testing.conversations.locomo import Conversation
from cwm_plugin.testing.conversations.topics import FACTS, OWN, Topic

DEFAULT_SEED = 0
DEFAULT_CONVERSATIONS = 6
SESSIONS = (16, 24)         # sessions a conversation, inclusive
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")
BLOCKS = (3, 5)             # topics a session, inclusive
FOLLOW_UP, NEWS = 0.35, 0.35  # a topic's odds: a follow-up (if one is due), news; else small talk
GUEST_CHANCE = 0.15         # a session where a relative says hello (after the greetings)

# How a session begins and ends ({you}: the one spoken to).
GREETINGS = [
    "Hey {you}! {gap} How have you been?",
    "Hi {you}, good to hear from you! How's everything?",
    "{you}! {gap} What's new with you?",
    "Morning {you}! How was your week?",
    "Hey {you}, do you have a minute to catch up?",
    "Hi {you}! I was just thinking about you. How are things?",
]
GAPS = {  # by the days since the last session
    0: ["", "So good to chat again!"],
    10: ["It's been a little while.", "Feels like ages since we talked."],
    21: ["It's been weeks!", "Long time no talk!"],
}
GREETING_REPLIES = [
    "Hi {you}! I've been {state}. How about you?",
    "Hey! All in all {state}, thanks for asking. You?",
    "Good to hear from you, {you}! Things have been {state} here.",
    "Oh hi! I'm {state}, honestly. Tell me your news first.",
]
CLOSINGS = [
    "I have to run, {errand}. Talk soon, {you}!",
    "This was lovely. Let's catch up again soon!",
    "Thanks for listening, {you}. I should {errand_verb} now.",
    "Oh, look at the time! I still need to {errand_verb}. Bye for now!",
]
ERRANDS = [("the shop closes in twenty minutes", "pick up groceries"),
           ("my bus is here", "catch my bus"),
           ("dinner is burning", "rescue dinner"),
           ("I said I'd help a neighbour", "help my neighbour with her boxes"),
           ("the laundry is waiting", "hang the laundry")]
CLOSING_REPLIES = ["Bye {you}! Take care.", "Talk soon! Say hi to everyone for me.",
                   "Good luck with everything, {you}!", "Enjoy the rest of your day!",
                   "Bye! Let's not leave it so long next time."]


def day(d: datetime) -> str:
    return f"{d.day} {MONTHS[d.month - 1]} {d.year}"


def date_time(d: datetime) -> str:
    """LoCoMo's session time: ``1:56 pm on 8 May, 2023``."""
    hour = d.hour % 12 or 12
    return f"{hour}:{d.minute:02d} {'am' if d.hour < 12 else 'pm'} on {d.day} " \
           f"{MONTHS[d.month - 1]}, {d.year}"


@dataclass
class _Person:
    name: str
    facts: list[Topic]                                  # the news still to tell, in order
    family: dict[str, str] = field(default_factory=dict)  # relation -> name


@dataclass
class _Told:
    """A topic told in a session: what filled it and the dia_ids of its lines."""

    topic: Topic
    owner: _Person
    values: dict
    ids: list[str]
    session: int
    ready: datetime                                     # its follow-up not before this


class _Draw:
    """The conversation's pools: each value drawn once (a question has one answer) until a
    pool runs dry, then it is reshuffled."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.left: dict[str, list] = {}

    def __call__(self, pool: str):
        if pool == "PEOPLE":
            pool = self.rng.choice(("WOMEN", "MEN"))
        left = self.left.get(pool)
        if not left:
            left = self.left[pool] = list(getattr(phrasebook, pool))
            self.rng.shuffle(left)
        return left.pop()


class _Session:
    """One session's turns, said in turn; questions and summary lines gathered as it goes."""

    def __init__(self, gen: _Conversation, number: int, when: datetime) -> None:
        self.gen, self.number, self.when = gen, number, when
        self.turns: list[dict] = []
        self.summary: list[str] = []
        self.topics: list[str] = []                     # told in it: each once a session

    def say(self, who: str, wordings: tuple[str, ...] | list[str], values: dict,
            wording: int | None = None) -> str:
        """``who`` says the ``wording``-th of ``wordings`` (any one if None), filled."""
        rng = self.gen.rng
        pick = rng.choice(wordings) if wording is None else wordings[wording % len(wordings)]
        text = pick.format_map({
            **values, "react": rng.choice(phrasebook.REACTIONS),
            "sympathy": rng.choice(phrasebook.SYMPATHY)})
        dia = f"D{self.number}:{len(self.turns) + 1}"
        self.turns.append({"speaker": who, "dia_id": dia, "text": text[:1].upper() + text[1:]})
        return dia

    def tell(self, topic: Topic, owner: _Person, other: _Person, values: dict,
             parent: _Told | None = None) -> _Told:
        values = {**values, "P": owner.name, "O": other.name}
        wording = self.gen.rng.randrange(max(len(ws) for _, ws in topic.lines))
        ids = [self.say(owner.name if who == OWN else other.name, ws, values, wording)
               for who, ws in topic.lines]
        summary = topic.summary.format_map(values)
        self.summary.append(summary[:1].upper() + summary[1:] + ".")
        self.topics.append(topic.name)
        for q in topic.questions:
            evidence = [parent.ids[int(e[1:])] if isinstance(e, str) else ids[e]
                        for e in q.evidence]
            self.gen.qa.append({"question": q.text.format_map(values),
                                "answer": q.answer.format_map(values),
                                "evidence": evidence, "category": q.category})
        ready = self.when
        if topic.after_when and "when_day" in values:
            ready = values["when_day"]
        return _Told(topic, owner, values, ids, self.number, ready)


class _Conversation:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.draw = _Draw(rng)
        self.people = [_Person(self.draw("PEOPLE"), rng.sample(FACTS, len(FACTS)))
                       for _ in range(2)]
        self.qa: list[dict] = []
        self.pending: list[_Told] = []                  # told, with a follow-up still to come

    def fill(self, topic: Topic, owner: _Person, when: datetime) -> dict:
        values: dict = {}
        for slot, pool in topic.slots.items():
            if slot == "when":
                values.update(self.when(pool, when))
                continue
            got = self.draw(pool)
            values.update(got if isinstance(got, dict) else {slot: got})
        if "rel" in values:     # one sister a person: the same name whenever she comes up
            values["relname"] = self.relative(owner, values["rel"], values["names"])
        return values

    def relative(self, person: _Person, rel: str, names: str) -> str:
        if rel not in person.family:
            person.family[rel] = self.draw(names)
        return person.family[rel]

    def when(self, kind: str, now: datetime) -> dict:
        """``{when}`` words for a day before (``past``) or after (``future``) ``now``."""
        rng = self.rng
        if kind == "past":
            words, back = rng.choice([("yesterday", 1), ("two days ago", 2),
                                       ("three days ago", 3), ("last Saturday", None),
                                       ("last week", 7)])
            if back is None:
                back = (now.weekday() - 5) % 7 or 7
            d = now - timedelta(days=back)
            answer = f"the week before {day(now)}" if words == "last week" else day(d)
        else:
            if rng.random() < 0.25:
                d = now + timedelta(days=(5 - now.weekday()) % 7 or 7)
                words = "next Saturday"
            else:
                d = now + timedelta(days=rng.randint(12, 70))
                words = f"on {d.day} {MONTHS[d.month - 1]}"
            answer = day(d)
        return {"when": words, "when_date": answer, "when_day": d}

    def session(self, number: int, when: datetime, gap: int) -> tuple[list[dict], str]:
        rng, (a, b) = self.rng, self.people
        s = _Session(self, number, when)
        first = rng.choice(self.people)
        second = b if first is a else a
        gaps = [w for days, ws in GAPS.items() if gap >= days for w in ws]
        s.say(first.name, GREETINGS, {"you": second.name, "gap": rng.choice(gaps)})
        s.say(second.name, GREETING_REPLIES,
              {"you": first.name, "state": rng.choice(phrasebook.STATES)})
        speaker = self.guest(s, first) if rng.random() < GUEST_CHANCE else first
        for k in range(rng.randint(*BLOCKS)):
            speaker = self.block(s, speaker, must_tell=k == 0)
        other = b if speaker is a else a
        errand, errand_verb = rng.choice(ERRANDS)
        s.say(speaker.name, CLOSINGS,
              {"you": other.name, "errand": errand, "errand_verb": errand_verb})
        s.say(other.name, CLOSING_REPLIES, {"you": speaker.name})
        head = f"{a.name} and {b.name} had a conversation on {day(when)} at " \
               f"{date_time(when).split(' on ')[0]}."
        for t in s.turns:
            t["text"] = t["text"].replace("  ", " ")  # an empty {gap}
        return s.turns, " ".join([head, *s.summary])

    def block(self, s: _Session, speaker: _Person, must_tell: bool) -> _Person:
        """One topic begun by ``speaker``; returns who speaks next."""
        rng, (a, b) = self.rng, self.people
        other = b if speaker is a else a
        later = [t for t in self.pending if t.session < s.number and t.ready < s.when
                 and (t.owner is speaker) == (t.topic.later.lines[0][0] == OWN)
                 and t.topic.later.name not in s.topics]
        news = [t for t in speaker.facts if t.name not in s.topics]
        roll = rng.random()
        if later and roll < FOLLOW_UP:
            told = rng.choice(later)
            self.pending.remove(told)
            owner = told.owner
            values = {**told.values, **self.fill(told.topic.later, owner, s.when)}
            s.tell(told.topic.later, owner, b if owner is a else a, values, parent=told)
        elif news and (must_tell or roll < FOLLOW_UP + NEWS):
            topic = news[-1]
            speaker.facts.remove(topic)
            told = s.tell(topic, speaker, other, self.fill(topic, speaker, s.when))
            if topic.later is not None:
                self.pending.append(told)
        else:
            topic = rng.choice([t for t in phrasebook.CHATS if t.name not in s.topics])
            s.tell(topic, speaker, other, self.fill(topic, speaker, s.when))
        return b if s.turns[-1]["speaker"] == a.name else a

    def guest(self, s: _Session, host: _Person) -> _Person:
        """A relative of ``host`` says hello: host, guest, the other; then the host again."""
        rng, (a, b) = self.rng, self.people
        other = b if host is a else a
        if host.family:
            rel = rng.choice(sorted(host.family))
        else:
            drawn = self.draw("RELATIVES")
            rel = drawn["rel"]
            self.relative(host, rel, drawn["names"])
        name, wording = host.family[rel], rng.randrange(2)
        values = {"rel": rel, "guest": name, "you": other.name, "host": host.name}
        s.say(host.name, ["Oh, my {rel} {guest} just got here and wants to say hi!",
                          "Hang on, {guest} is here. My {rel} says hello!"], values, wording)
        s.say(name, ["Hi {you}! {host} talks about you all the time.",
                     "Hello {you}! Don't believe anything {host} says about me."],
              values, wording)
        s.say(other.name, ["Hi {guest}! Lovely to meet you at last.",
                           "Ha, hello {guest}! Only good things, I promise."], values, wording)
        s.summary.append(f"{host.name}'s {rel} {name} said hello to {other.name}.")
        return host


def generate(seed: int = DEFAULT_SEED, conversations: int = DEFAULT_CONVERSATIONS,
             sessions: tuple[int, int] = SESSIONS) -> list[Conversation]:
    """``conversations`` conversations of ``sessions`` (low, high) sessions each."""
    out = []
    for i in range(conversations):
        rng = random.Random(seed * 1_000_003 + i)
        gen = _Conversation(rng)
        a, b = gen.people
        data: dict = {"speaker_a": a.name, "speaker_b": b.name}
        when = datetime(2022, 1, 3, rng.randint(8, 21), rng.randrange(60)) \
            + timedelta(days=rng.randrange(900))
        gap = 0
        for n in range(1, rng.randint(*sessions) + 1):
            turns, summary = gen.session(n, when, gap)
            data[f"session_{n}_date_time"] = date_time(when)
            data[f"session_{n}"] = turns
            data[f"session_{n}_summary"] = summary
            gap = rng.randint(3, 28)
            when = (when + timedelta(days=gap)).replace(hour=rng.randint(8, 21),
                                                        minute=rng.randrange(60))
        out.append(Conversation(f"generated-{seed}-{i}", data, gen.qa))
    return out


@functools.cache
def default_conversations() -> tuple[Conversation, ...]:
    """The conversations everything uses unless told otherwise (``generate()``'s defaults)."""
    return tuple(generate())
