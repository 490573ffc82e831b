"""One client API for context windows, over the sidecar's REST or straight over the store.

The CLI (``cwm window``) and the MCP tools (``cwm mcp``) call a :class:`WindowsClient`:

* :class:`HttpWindows` talks to a running sidecar with a tenant's API key, as one of its users
  when given one (``X-CWM-User``: that user's windows and sessions); the sidecar derives the
  sessions' salts and does the work, and its errors are raised with their codes;
* :class:`LocalWindows` opens the KV store itself (``--store``) and runs the engine in this
  process, deriving salts with the function it is given (the sidecar's rule and secret).

Both return plain dicts shaped like the REST answers, and raise :class:`CWMError` subclasses.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from cwm_plugin.errors import InvalidInput, UpstreamError, remote_error
from cwm_plugin.windows.auto import AutoFreeze
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.portable import export_window, import_window

USER_HEADER = "X-CWM-User"


class WindowsClient(Protocol):
    def freeze(self, name: str, session: str, **options: Any) -> dict[str, Any]: ...
    def thaw(self, name: str, session: str | None = None, *, warm: bool = False,
             model: str | None = None) -> dict[str, Any]: ...
    def clone(self, name: str, new_name: str, **options: Any) -> dict[str, Any]: ...
    def list(self, **filters: Any) -> dict[str, Any]: ...
    def status(self, name: str) -> dict[str, Any]: ...
    def update(self, name: str, *, new_name: str | None = None,
               tags: list[str] | None = None, description: str | None = None
               ) -> dict[str, Any]: ...
    def delete(self, name: str) -> dict[str, Any]: ...
    def export(self, name: str, path: str) -> dict[str, Any]: ...
    def import_file(self, path: str, name: str | None = None) -> dict[str, Any]: ...
    def clear_session(self, session: str) -> dict[str, Any]: ...
    def continue_chat(self, session: str, messages: list[dict[str, Any]],
                      model: str | None) -> dict[str, Any]: ...
    def stats(self) -> dict[str, Any]: ...
    def sessions(self) -> dict[str, Any]: ...
    def health(self) -> dict[str, Any]: ...
    def auto_freeze_config(self, **changes: Any) -> dict[str, Any]: ...
    def auto_freeze_check(self, session: str, **usage: Any) -> dict[str, Any]: ...


def _given(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if v is not None}


def _error_of(r: Any) -> Exception:
    """The sidecar's error in a response of status >= 400, with its code and message."""
    try:
        err = r.json().get("error", {})
    except (ValueError, AttributeError):
        err = {}
    if not isinstance(err, dict):
        err = {}
    return remote_error(str(err.get("code") or ""),
                        str(err.get("message") or f"HTTP {r.status_code}"), r.status_code)


class HttpWindows:
    def __init__(self, url: str, api_key: str, *, user: str | None = None,
                 timeout: float = 120.0) -> None:
        """``user``: act as this user of the key's tenant (its own windows and sessions)."""
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"}
        if user is not None:
            headers[USER_HEADER] = user
        self._http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout, headers=headers)

    def __repr__(self) -> str:
        return f"HttpWindows({self._http.base_url})"

    def _send(self, method: str, path: str, **kw: Any) -> Any:
        import httpx

        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"cannot reach the sidecar at {self._http.base_url}: {exc}",
                                hint="is `cwm serve` running? check --url") from exc
        if r.status_code >= 400:
            raise _error_of(r)
        return r

    def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        try:
            return self._send(method, path, **kw).json()
        except ValueError:
            return {}

    def freeze(self, name: str, session: str, **options: Any) -> dict[str, Any]:
        """``options``: tags, description, turn, ttl_s, prompt_prefix, messages."""
        return self._call("POST", "/v1/windows", json={"name": name, "session": session,
                                                       **_given(options)})

    def thaw(self, name: str, session: str | None = None, *, warm: bool = False,
             model: str | None = None) -> dict[str, Any]:
        if session is None:
            session = self.status(name)["session"]
        return self._call("POST", f"/v1/windows/{name}/thaw",
                          json={"session": session, "warm": warm, "model": model})

    def continue_chat(self, session: str, messages: list[dict[str, Any]],
                      model: str | None) -> dict[str, Any]:
        """One chat turn in ``session`` through the sidecar (after a thaw)."""
        if model is None:
            raise InvalidInput("the window names no model to continue with")
        return self._call("POST", "/v1/chat/completions", headers={"X-Session-Id": session},
                          json={"model": model, "messages": messages})

    def clone(self, name: str, new_name: str, **options: Any) -> dict[str, Any]:
        return self._call("POST", f"/v1/windows/{name}/clone",
                          json={"name": new_name, **_given(options)})

    def list(self, **filters: Any) -> dict[str, Any]:
        return self._call("GET", "/v1/windows", params=_given(filters))

    def status(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/windows/{name}")

    def update(self, name: str, *, new_name: str | None = None,
               tags: list[str] | None = None, description: str | None = None
               ) -> dict[str, Any]:
        return self._call("PATCH", f"/v1/windows/{name}", json=_given(
            {"name": new_name, "tags": tags, "description": description}))

    def delete(self, name: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/windows/{name}")

    def export(self, name: str, path: str) -> dict[str, Any]:
        size = 0
        with self._http.stream("GET", f"/v1/windows/{name}/export") as r:
            if r.status_code >= 400:
                r.read()
                raise _error_of(r)
            with open(path, "wb") as out:
                for chunk in r.iter_bytes():
                    out.write(chunk)
                    size += len(chunk)
        return {"object": "window.export", "name": name, "path": path, "bytes": size}

    def import_file(self, path: str, name: str | None = None) -> dict[str, Any]:
        with open(path, "rb") as src:
            return self._call("POST", "/v1/windows/import", content=src,
                              params=_given({"name": name}),
                              headers={"Content-Type": "application/octet-stream",
                                       "Content-Length": str(Path(path).stat().st_size)})

    def clear_session(self, session: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/sessions/{session}/kv")

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/v1/cache/stats")

    def sessions(self) -> dict[str, Any]:
        return self._call("GET", "/v1/sessions")

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def auto_freeze_config(self, **changes: Any) -> dict[str, Any]:
        changes = _given(changes)
        if changes:
            return self._call("POST", "/v1/auto_freeze", json=changes)
        return self._call("GET", "/v1/auto_freeze")

    def auto_freeze_check(self, session: str, **usage: Any) -> dict[str, Any]:
        return self._call("POST", "/v1/auto_freeze/check",
                          json={"session": session, **_given(usage)})


class LocalWindows:
    """The engine in this process, for one owner (a tenant, or ``tenant/u-...``: a user's,
    whose sessions are salted per user); ``salt_of(owner, session)``."""

    def __init__(self, engine: WindowEngine, tenant: str,
                 salt_of: Callable[[str, str], str]) -> None:
        self.engine = engine
        self.tenant = tenant
        self._salt_of = salt_of
        self.auto = AutoFreeze(engine)

    def __repr__(self) -> str:
        return f"LocalWindows(tenant={self.tenant!r})"

    def _salt(self, session: str) -> str:
        return self._salt_of(self.tenant, session)

    def freeze(self, name: str, session: str, **options: Any) -> dict[str, Any]:
        m = self.engine.freeze(self.tenant, name, session=session, salt=self._salt(session),
                               **_given(options))
        return {"object": "window", **m.public()}

    def thaw(self, name: str, session: str | None = None, *, warm: bool = False,
             model: str | None = None) -> dict[str, Any]:
        session = session or self.engine.get(self.tenant, name).session
        r = self.engine.thaw(self.tenant, name, session=session, salt=self._salt(session),
                             model=model)
        if warm:  # not an error: the thaw stands, and the session's next request restores
            r.warnings.append("no warm-up: it goes through vLLM (thaw through the sidecar, "
                              "--url, to warm); the session's next request restores instead")
        return {"object": "window.thaw", **r.public()}

    def continue_chat(self, session: str, messages: list[dict[str, Any]],
                      model: str | None) -> dict[str, Any]:
        raise InvalidInput("continuing a conversation goes through vLLM: use the sidecar "
                           "(--url), or send the session's next request yourself")

    def clone(self, name: str, new_name: str, **options: Any) -> dict[str, Any]:
        m = self.engine.clone(self.tenant, name, new_name, **_given(options))
        return {"object": "window", **m.public()}

    def list(self, **filters: Any) -> dict[str, Any]:
        order = filters.pop("order", "desc")
        text = filters.pop("q", None)
        if isinstance(filters.get("tag"), list):  # the REST's repeatable tag: all of them
            filters["tags"] = filters.pop("tag")
        page, total = self.engine.list(self.tenant, text=text, descending=order == "desc",
                                       **_given(filters))
        return {"object": "list", "data": [m.public() for m in page], "total": total}

    def status(self, name: str) -> dict[str, Any]:
        return {"object": "window", **self.engine.status(self.tenant, name)}

    def update(self, name: str, *, new_name: str | None = None,
               tags: list[str] | None = None, description: str | None = None
               ) -> dict[str, Any]:
        m = self.engine.patch(self.tenant, name, new_name=new_name, tags=tags,
                              description=description)
        return {"object": "window", **m.public()}

    def delete(self, name: str) -> dict[str, Any]:
        self.engine.delete(self.tenant, name)
        return {"object": "window.deleted", "name": name, "deleted": True}

    def export(self, name: str, path: str) -> dict[str, Any]:
        with open(path, "wb") as out:
            summary = export_window(self.engine, self.tenant, name, out)
        return {"object": "window.export", "path": path, **summary}

    def import_file(self, path: str, name: str | None = None) -> dict[str, Any]:
        with open(path, "rb") as src:
            m = import_window(self.engine, self.tenant, src, name)
        return {"object": "window", **m.public()}

    def clear_session(self, session: str) -> dict[str, Any]:
        n = self.engine.clear_session(self._salt(session))
        return {"object": "session.kv.deleted", "session": session, "keys_deleted": n}

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
        return self.auto.check(self.tenant, session, self._salt(session), **usage)
