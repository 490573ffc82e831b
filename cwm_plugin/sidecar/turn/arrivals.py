"""A session's client turns as they arrive: their numbers, their order, and which of them may
still be leaving records in the store.

Every request the sidecar forwards under a session's salt (chat, completions, responses) is a
client turn. It is numbered when it arrives -- a chat in ``full`` history mode by the client's
user messages, anything else as the session's next number -- and stamped with its arrival
time (unix seconds, strictly increasing within the session). Both go to the connector in
``kv_transfer_params`` (:func:`kv_params`): the number names the slot its context record is
kept under, the arrival orders the records, so a turn that finishes late never replaces the
record of a turn that arrived after it (:mod:`cwm_plugin.connector.records`). A request of no
session is no turn: it goes up with ``record: false`` and leaves no context record.

A window freeze waits only for what is on its way (:meth:`Arrivals.coming`): the session's
turns in flight (up to ``windows.wait_s``), and those that ended less than ``RECORD_GRACE_S``
ago (the connector writes the record as vLLM finishes the request; a turn that left none, too
short to fill a block, costs a freeze that grace at most). Nothing else is worth a wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

RECORD_GRACE_S = 5.0  # after a turn ended, how long its record may still take to land
DEFAULT_KEEP = 8      # turns a session keeps records of, without windows settings
MAX_OPEN = 64         # arrivals of one session tracked at once (the oldest are let go)


@dataclass
class Arrival:
    turn: int
    at: float                    # unix time it arrived (orders the session's records)
    ended: float | None = None   # monotonic time it ended (None: in flight)


@dataclass
class Arrivals:
    """One session's arrivals (its :class:`~cwm_plugin.sidecar.turn.session.SessionState`'s)."""

    last_turn: int = 0
    last_at: float = 0.0
    open: list[Arrival] = field(default_factory=list)  # whose records may still come

    def number(self, turn: int | None = None) -> int:
        """``turn``, or (None) the number the session's next turn gets."""
        return turn if turn is not None else self.last_turn + 1

    def arrive(self, turn: int | None = None) -> Arrival:
        """A turn arrives now: number ``turn`` (None: the session's next number)."""
        number = self.number(turn)
        self.last_turn = max(self.last_turn, number)
        self.last_at = max(time.time(), self.last_at + 1e-6)
        arrival = Arrival(number, self.last_at)
        self._prune()
        self.open.append(arrival)
        del self.open[:-MAX_OPEN]
        return arrival

    @staticmethod
    def end(arrival: Arrival | None) -> None:
        """The turn is answered (or failed): its record, if any, lands within moments."""
        if arrival is not None and arrival.ended is None:
            arrival.ended = time.monotonic()

    def coming(self) -> dict[int, float]:
        """Turn -> latest arrival, of the turns whose records may still be on their way."""
        self._prune()
        out: dict[int, float] = {}
        for a in self.open:
            out[a.turn] = max(out.get(a.turn, 0.0), a.at)
        return out

    def patience(self, limit: float) -> float:
        """How long the coming records are worth waiting for: ``limit`` while a turn is in
        flight, else what is left of the ended turns' grace (0: nothing is coming)."""
        self._prune()
        now = time.monotonic()
        return max((limit if a.ended is None else min(limit, a.ended + RECORD_GRACE_S - now)
                    for a in self.open), default=0.0)

    def _prune(self) -> None:
        now = time.monotonic()
        self.open = [a for a in self.open if a.ended is None or now - a.ended < RECORD_GRACE_S]


def kv_params(arrival: Arrival | None, windows: Any) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a client request (``windows``: the sidecar's windows
    settings, whose ``keep_turns`` it sends). ``arrival`` None: no conversation turn (a
    stateless request, no session), which leaves no context record (``record: false``), so it
    never becomes the latest turn of a session sharing its salt (a client's own
    ``cache_salt``, say)."""
    if arrival is None:
        return {"cwm": {"record": False}}
    keep = windows.keep_turns if windows is not None else DEFAULT_KEEP
    return {"cwm": {"turn": arrival.turn, "keep": keep, "at": arrival.at}}
