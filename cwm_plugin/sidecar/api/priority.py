"""Request priority on upstreams that schedule by it (vLLM's ``--scheduling-policy priority``:
lower goes first, then earlier arrival; ``upstreams[].priority_scheduling``).

A client's own ``priority`` is forwarded as sent only for a principal with the ``priority``
grant; without it the value is raised to 0 at least, so a client may put its own requests
after others' and never ahead of another tenant's (:func:`client_priority`). vLLM's
``X-Vllm-Priority`` header, which would override the body, never reaches it: the sidecar
forwards no client header but ``X-Request-Id``. A chat turn of a session whose
earlier turn this sidecar answered, or whose context record it found in the store after a
restart (so its prefix was computed and its KV is in vLLM's cache or our store: what the
sidecar knows, never what the client's messages claim), that names no priority of its own gets
``routing.returning_priority`` on the upstreams that schedule by priority
(:func:`returning_priority`; the router sets it per upstream, since one without the policy
refuses any priority but 0, and a resumed stream keeps it), so a returning session is restored
and answered ahead of queued first turns.
"""

from __future__ import annotations

from typing import Any

from cwm_plugin.errors import InvalidInput
from cwm_plugin.sidecar.identity.access import Permissions
from cwm_plugin.sidecar.identity.authenticator import Identity
from cwm_plugin.sidecar.turn.session import SessionState

INT64 = 2**63 - 1


def client_priority(body: dict[str, Any], perms: Permissions, ident: Identity
                    ) -> dict[str, Any]:
    """``body`` with its ``priority`` as the sidecar forwards it (see the module docstring);
    a priority that is not an integer is a clear 400."""
    if "priority" not in body:
        return body
    value = body["priority"]
    if value is None:  # as if not sent (vLLM takes an integer only)
        return {k: v for k, v in body.items() if k != "priority"}
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > INT64:
        raise InvalidInput("`priority` must be an integer (lower goes first; default 0)")
    if value < 0 and not perms.granted(ident.tenant, "priority", bound=ident.bound):
        return {**body, "priority": 0}  # never ahead of others without the grant
    return body


def returning_priority(body: dict[str, Any], state: SessionState, session: str | None,
                       setting: int | None) -> int | None:
    """The priority the router gives a chat turn on priority-scheduling upstreams: the
    setting for a turn of a session that returns (see the module docstring) and names no
    priority of its own; else None."""
    if setting is None or session is None or "priority" in body:
        return None
    return setting if state.last_prompt_tokens > 0 or state.stored else None
