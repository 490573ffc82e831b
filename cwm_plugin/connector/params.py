"""What a request tells the connector about itself, through vLLM's ``kv_transfer_params``.

A client (the cwm sidecar) may send ``"kv_transfer_params": {"cwm": {...}}`` with a chat or
completion request; vLLM hands it to the connector as ``request.kv_transfer_params``:

* ``turn`` (int >= 1): the client turn of its conversation this request is. The context record
  is then also kept under the turn's slot (``turn % keep``), so a session's last ``keep`` client
  turns can be frozen, not only its latest request.
* ``keep`` (1..256, default 8): how many turns' records a session keeps.
* ``at`` (unix seconds): when the client turn arrived at the sidecar. Its records carry it, and
  a record of a turn that arrived earlier never replaces a later one's
  (:mod:`~cwm_plugin.connector.records`): the order of arrival, not of finishing, decides.
* ``record`` (bool, default true): false leaves no context record (a warm-up request, say),
  so the session's records stay the conversation's.
* ``store`` (bool, default true): false neither looks the request up nor saves its blocks nor
  records it (the sidecar's own background prompts: summaries and fact extraction).

Anything malformed is ignored (the defaults apply): a client's parameter never fails a request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_KEEP = 256


@dataclass(frozen=True)
class RequestParams:
    turn: int | None = None
    keep: int = 8
    record: bool = True
    store: bool = True
    at: float | None = None

    @property
    def slot(self) -> int | None:
        """The turn's record slot (None: the request names no turn)."""
        return None if self.turn is None else self.turn % self.keep


DEFAULT = RequestParams()


def params_of(request: Any) -> RequestParams:
    """The ``cwm`` part of a request's ``kv_transfer_params`` (defaults where absent or bad)."""
    raw = getattr(request, "kv_transfer_params", None)
    cwm = raw.get("cwm") if isinstance(raw, dict) else None
    if not isinstance(cwm, dict):
        return DEFAULT
    turn = cwm.get("turn")
    keep = cwm.get("keep", DEFAULT.keep)
    at = cwm.get("at")
    return RequestParams(
        turn=turn if isinstance(turn, int) and not isinstance(turn, bool) and turn >= 1
        else None,
        keep=keep if isinstance(keep, int) and not isinstance(keep, bool)
        and 1 <= keep <= MAX_KEEP else DEFAULT.keep,
        record=cwm.get("record") is not False,
        store=cwm.get("store") is not False,
        at=float(at) if isinstance(at, int | float) and not isinstance(at, bool)
        and math.isfinite(at) and at > 0 else None)
