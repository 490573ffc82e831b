"""One client API for context windows, over the sidecar's REST or straight over the store.

The CLI (``cwm window``) and the MCP tools (``cwm mcp``) call a :class:`WindowsClient`:

* :class:`HttpWindows` talks to a running sidecar with a tenant's API key (the sidecar derives
  the sessions' salts and does the work);
* :class:`LocalWindows` opens the KV store itself (``--store``) and runs the engine in this
  process, deriving salts with the function it is given (the sidecar's rule and secret).

Both return plain dicts shaped like the REST answers, and raise :class:`CWMError` subclasses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from cwm_plugin.errors import (
    AlreadyExists,
    CWMError,
    Forbidden,
    InvalidInput,
    NotFound,
    UpstreamError,
)
from cwm_plugin.windows.auto import AutoFreeze
from cwm_plugin.windows.engine import ModelMismatch, WindowEngine, WindowIncomplete

_BY_CODE: dict[str, type[CWMError]] = {c.code: c for c in (
    AlreadyExists, NotFound, InvalidInput, Forbidden, WindowIncomplete, ModelMismatch)}


class WindowsClient(Protocol):
    def freeze(self, name: str, session: str, *, tags: list[str] | None = None,
               description: str = "") -> dict[str, Any]: ...
    def thaw(self, name: str, session: str | None = None, *, warm: bool = False,
             model: str | None = None) -> dict[str, Any]: ...
    def clone(self, name: str, new_name: str) -> dict[str, Any]: ...
    def list(self, **filters: Any) -> dict[str, Any]: ...
    def status(self, name: str) -> dict[str, Any]: ...
    def delete(self, name: str) -> dict[str, Any]: ...
    def stats(self) -> dict[str, Any]: ...
    def sessions(self) -> dict[str, Any]: ...
    def health(self) -> dict[str, Any]: ...
    def auto_freeze_config(self, **changes: Any) -> dict[str, Any]: ...
    def auto_freeze_check(self, session: str, **usage: Any) -> dict[str, Any]: ...


class HttpWindows:
    def __init__(self, url: str, api_key: str, *, timeout: float = 120.0) -> None:
        import httpx

        self._http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout,
                                  headers={"Authorization": f"Bearer {api_key}"})

    def __repr__(self) -> str:
        return f"HttpWindows({self._http.base_url})"

    def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        import httpx

        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"cannot reach the sidecar at {self._http.base_url}: {exc}",
                                hint="is `cwm serve` running? check --url") from exc
        try:
            body = r.json()
        except ValueError:
            body = {}
        if r.status_code >= 400:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            cls = _BY_CODE.get(str(err.get("code")), CWMError)
            raise cls(str(err.get("message") or f"HTTP {r.status_code}"))
        return body

    def freeze(self, name: str, session: str, *, tags: list[str] | None = None,
               description: str = "") -> dict[str, Any]:
        return self._call("POST", "/v1/windows", json={
            "name": name, "session": session, "tags": tags or [], "description": description})

    def thaw(self, name: str, session: str | None = None, *, warm: bool = False,
             model: str | None = None) -> dict[str, Any]:
        if session is None:
            session = self.status(name)["session"]
        return self._call("POST", f"/v1/windows/{name}/thaw",
                          json={"session": session, "warm": warm, "model": model})

    def clone(self, name: str, new_name: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/windows/{name}/clone", json={"name": new_name})

    def list(self, **filters: Any) -> dict[str, Any]:
        return self._call("GET", "/v1/windows",
                          params={k: v for k, v in filters.items() if v is not None})

    def status(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/windows/{name}")

    def delete(self, name: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/windows/{name}")

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/v1/cache/stats")

    def sessions(self) -> dict[str, Any]:
        return self._call("GET", "/v1/sessions")

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def auto_freeze_config(self, **changes: Any) -> dict[str, Any]:
        changes = {k: v for k, v in changes.items() if v is not None}
        if changes:
            return self._call("POST", "/v1/auto_freeze", json=changes)
        return self._call("GET", "/v1/auto_freeze")

    def auto_freeze_check(self, session: str, **usage: Any) -> dict[str, Any]:
        return self._call("POST", "/v1/auto_freeze/check",
                          json={"session": session, **{k: v for k, v in usage.items()
                                                       if v is not None}})


class LocalWindows:
    """The engine in this process, for one tenant; ``salt_of(tenant, session)``."""

    def __init__(self, engine: WindowEngine, tenant: str,
                 salt_of: Callable[[str, str], str]) -> None:
        self.engine = engine
        self.tenant = tenant
        self._salt_of = salt_of
        self.auto = AutoFreeze(engine)

    def __repr__(self) -> str:
        return f"LocalWindows(tenant={self.tenant!r})"

    def freeze(self, name: str, session: str, *, tags: list[str] | None = None,
               description: str = "") -> dict[str, Any]:
        m = self.engine.freeze(self.tenant, name, session=session,
                               salt=self._salt_of(self.tenant, session), tags=tags or [],
                               description=description)
        return {"object": "window", **m.public()}

    def thaw(self, name: str, session: str | None = None, *, warm: bool = False,
             model: str | None = None) -> dict[str, Any]:
        session = session or self.engine.get(self.tenant, name).session
        if warm:
            raise InvalidInput("a warm-up goes through vLLM: thaw through the sidecar (--url) "
                               "to warm, or send the session's next request")
        r = self.engine.thaw(self.tenant, name, session=session,
                             salt=self._salt_of(self.tenant, session), model=model)
        return {"object": "window.thaw", **r.public()}

    def clone(self, name: str, new_name: str) -> dict[str, Any]:
        return {"object": "window", **self.engine.clone(self.tenant, name, new_name).public()}

    def list(self, **filters: Any) -> dict[str, Any]:
        order = filters.pop("order", "desc")
        text = filters.pop("q", None)
        page, total = self.engine.list(self.tenant, text=text, descending=order == "desc",
                                       **{k: v for k, v in filters.items() if v is not None})
        return {"object": "list", "data": [m.public() for m in page], "total": total}

    def status(self, name: str) -> dict[str, Any]:
        return {"object": "window", **self.engine.status(self.tenant, name)}

    def delete(self, name: str) -> dict[str, Any]:
        self.engine.delete(self.tenant, name)
        return {"object": "window.deleted", "name": name, "deleted": True}

    def stats(self) -> dict[str, Any]:
        return {"object": "cache.stats", "tiers": self.engine.store.usage()}

    def sessions(self) -> dict[str, Any]:
        page, _ = self.engine.list(self.tenant, limit=100_000)
        names = sorted({m.session for m in page})
        return {"object": "list", "data": [{"session": s, "windows": sum(
            m.session == s for m in page)} for s in names]}

    def health(self) -> dict[str, Any]:
        tiers = {t.name: getattr(t, "available", True) for t in self.engine.store.tiers}
        return {"status": "ok" if tiers and all(tiers.values()) else "degraded",
                "tiers": tiers}

    def auto_freeze_config(self, **changes: Any) -> dict[str, Any]:
        self.auto.update(**changes)
        return self.auto.settings(changes.get("model"))

    def auto_freeze_check(self, session: str, **usage: Any) -> dict[str, Any]:
        return self.auto.check(self.tenant, session, self._salt_of(self.tenant, session),
                               **usage)
