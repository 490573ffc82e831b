"""What a client turn leaves behind for context windows, and what it picks up again.

* The turn's number and arrival go to vLLM in ``kv_transfer_params`` (``{"cwm": {"turn",
  "keep", "at"}}``, :mod:`.arrivals`, :mod:`cwm_plugin.connector.params`): the connector keeps
  the context record of each of the session's last ``keep`` client turns, so a freeze takes
  the latest client turn (or an earlier one), never the sidecar's own background prompts
  (which run under a salt of their own). A client's own ``kv_transfer_params`` are never
  forwarded.
* After the answer, with a windows store configured, the sidecar leaves the turn's
  :class:`~cwm_plugin.windows.conversation.ConversationRecord` (the client's messages and the
  answer, up to ``windows.max_message_bytes``; what its plan merged into the prompt, taken
  when the prompt was assembled, so a concurrent turn of the session never stamps its own
  onto this turn's KV) in the store, written in the background, with the turn's arrival.
* A session this process has not seen that continues a conversation (a thawed window, a
  restart, another sidecar) takes the prompt state of its previous turn from the store first,
  so its prompt begins with the tokens its KV was computed for (memory selected once per
  conversation stays the same block). The read runs on threads of its own (:func:`restores`:
  ``RESTORE_THREADS`` a principal, ``RESTORE_WAITING`` more waiting, else skipped at once),
  never on those other work (chat's planning) runs on, and the turn waits for it at most
  ``RESTORE_TIMEOUT_S``: a hung store costs a principal at most its share of these threads and
  its turns nothing more than that wait.

The turn number is the count of the client's user messages (full history mode), or the
session's next number (``recent`` mode, where the history is the server's; other routes).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import Counter

from cwm_plugin.sidecar.identity.tenant_bounds import TenantBound, TenantPool
from cwm_plugin.sidecar.turn.arrivals import Arrival
from cwm_plugin.sidecar.turn.session import SessionState
from cwm_plugin.windows.conversation import ConversationRecord, capped_messages

log = logging.getLogger(__name__)
RESTORE_TIMEOUT_S = 1.0  # a store that does not answer within this costs the turn nothing more
RESTORE_THREADS = 1  # a principal's reads at once ...
RESTORE_WAITING = 64  # ... and waiting for one of those (past it, the turn goes on without)


def restores(principals: int, counter: Counter) -> TenantPool:
    """The threads prompt-state reads run on (see the module docstring)."""
    return TenantPool("cwm-restores", TenantBound("prompt_restores", "prompt-state reads",
                                                  RESTORE_THREADS, RESTORE_WAITING, counter),
                      principals)


def client_turn(messages: list[dict[str, Any]], mode: str) -> int | None:
    """The number of a chat turn (None: the session's next)."""
    if mode == "recent":
        return None
    return max(1, sum(1 for m in messages if m.get("role") == "user"))


def answer_message(content: str | None, tool_calls: list[dict[str, Any]] | None
                   ) -> dict[str, Any]:
    """The answer as the client holds it in its history (what it sends back next turn)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


async def restore_prompt(sc: Any, tenant: str, salt: str, state: SessionState, turn: int,
                         messages: list[dict[str, Any]]) -> None:
    """Adopt the stored prompt state of the turn this request continues (the one before
    ``turn`` when it starts with a new user message, else ``turn`` itself: tool results) for a
    session of ``tenant``'s this process has not seen (never fails the turn: a miss selects
    anew)."""
    previous = turn - 1 if messages and messages[-1].get("role") == "user" else turn
    if sc.windows is None or state.restored or previous < 1 or state.pinned is not None \
            or not any(m.get("role") == "assistant" for m in messages):
        return
    state.restored = True
    try:
        records = sc.windows.conversations
        rec = await asyncio.wait_for(sc.restores.run(
            tenant, lambda: records.read(salt, previous)), RESTORE_TIMEOUT_S)
    except Exception as exc:  # a store down or slow, reads past the bound: goes on without
        sc.metrics.windows_restores.labels("error").inc()
        log.info("the prompt state of a continuing session could not be read: %s", exc)
        return
    state.stored = rec is not None
    if rec is not None and state.adopt(rec.prompt):
        sc.metrics.windows_restores.labels("adopted").inc()


def save_turn(sc: Any, salt: str, arrival: Arrival, prompt: dict[str, Any], model: str,
              messages: list[dict[str, Any]], answer: dict[str, Any]) -> None:
    """Leave the turn's conversation record in the store (in the background; never raises);
    ``prompt``: the prompt state its plan assembled the prompt with."""
    if sc.windows is None:
        return
    kept, dropped = capped_messages([*messages, answer], sc.settings.windows.max_message_bytes)
    try:
        sc.windows.conversations.write(salt, ConversationRecord(
            arrival.turn, kept, prompt, model, messages_dropped=dropped, arrived=arrival.at))
    except Exception as exc:  # a closed or full store: the KV still freezes without it
        log.warning("a conversation record could not be queued: %s", exc)
