"""Request priority on upstreams that schedule by it (vLLM's ``--scheduling-policy priority``:
lower goes first, then earlier arrival; ``upstreams[].priority_scheduling``).

A client's own ``priority`` is forwarded as sent only for a principal with the ``priority``
grant; without it the value is raised to 0 at least, so a client may put its own requests
after others' and never ahead of another tenant's (:func:`client_priority`). vLLM's
``X-Vllm-Priority`` header, which would override the body, never reaches it: the sidecar
forwards no client header but ``X-Request-Id``. A chat turn that continues a conversation
(its prefix was computed before, so its KV is in vLLM's cache or our store) and names no
priority of its own gets ``routing.returning_priority`` on the upstreams that schedule by
priority (:func:`returning_priority`; the router sets it per upstream, since one without the
policy refuses any priority but 0), so a returning session is restored and answered ahead of
queued first turns.
"""

from __future__ import annotations

from typing import Any

from cwm_plugin.errors import InvalidInput
from cwm_plugin.sidecar.identity.access import Permissions
from cwm_plugin.sidecar.identity.authenticator import Identity

INT64 = 2**63 - 1


def client_priority(body: dict[str, Any], perms: Permissions, ident: Identity
                    ) -> dict[str, Any]:
    """``body`` with its ``priority`` as the sidecar forwards it (see the module docstring);
    a priority that is not an integer is a clear 400."""
    if "priority" not in body or body["priority"] is None:
        return body
    value = body["priority"]
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > INT64:
        raise InvalidInput("`priority` must be an integer (lower goes first; default 0)")
    if value < 0 and not perms.granted(ident.tenant, "priority", bound=ident.bound):
        return {**body, "priority": 0}  # never ahead of others without the grant
    return body


def returning_priority(body: dict[str, Any], number: int | None, last_prompt_tokens: int,
                       setting: int | None) -> int | None:
    """The priority the router gives a chat turn on priority-scheduling upstreams: the
    setting for a turn that continues a conversation (``number`` > 1, or this session's
    previous turn answered here) and names none of its own; else None."""
    if setting is None or body.get("priority") is not None:
        return None
    continuing = (number is not None and number > 1) or last_prompt_tokens > 0
    return setting if continuing else None
