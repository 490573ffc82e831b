"""Which memory folders the work at hand may read and change: the row-level security scope.

The memory's tables in PostgreSQL are under row-level security (``memory/postgres/schema.py``,
version 5): a row is visible only when its folder is in the connection's ``cwm.read`` setting
(for the derived index: its space in ``cwm.spaces``), and changed only when it is in
``cwm.write``; ``'*'`` is every folder (maintenance, the operator's tools). :class:`~cwm_plugin.
pg_pool.PgPool` copies the scope of the current context into each connection it hands out.

The scope is set apart from the folder arguments of the queries, by whoever decided what the
work may touch: the sidecar from its permission matrix (a request's home and the namespaces it
was allowed), a background job from the folder it was queued for, a maintainer or a CLI for
everything. So a query that forgets its folder, or is handed another tenant's, finds nothing
instead of another tenant's rows. Work with no scope set is refused (the pool logs it
once, and raises the owner's error: the sidecar answers without memory): a path that was never
scoped fails closed, and loudly (an empty answer would read as "every session deleted" to a
replica's local index).

It is a :class:`contextvars.ContextVar`: asyncio tasks inherit it; a thread does when it is
started through :func:`carried` (the sidecar's memory threads are).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
ALL = "*"  # the value of cwm.read / cwm.write that stands for every folder


@dataclass(frozen=True)
class Scope:
    """The folders a piece of work may read (their search index included) and change."""

    read: frozenset[str] = frozenset()
    write: frozenset[str] = frozenset()
    everything: bool = False

    def settings(self, prefixes: Iterable[str] = ()) -> tuple[str, str, str]:
        """``(cwm.read, cwm.spaces, cwm.write)`` for a connection, comma-separated (folder
        names hold no comma: ``memory/files/names.py``): the folders read, each of them under
        every index space ``prefix`` in use (``<fingerprint>/``: the index's rows), the
        folders written. (Apart, so each policy compares a row with the shortest list.)"""
        if self.everything:
            return ALL, ALL, ALL
        read = sorted(self.read | self.write)
        return (",".join(read), ",".join(p + f for p in sorted(set(prefixes)) for f in read),
                ",".join(sorted(self.write)))


EVERYTHING = Scope(everything=True)
NOTHING = Scope()
_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("cwm_pg_scope",
                                                                     default=None)


def folders(read: Iterable[str | None] = (), write: Iterable[str | None] = ()) -> Scope:
    """A scope of the folders named (None entries, namespaces without a folder, left out)."""
    w = frozenset(f for f in write if f)
    return Scope(frozenset(f for f in read if f) | w, w)


def current() -> Scope | None:
    """The scope of the work at hand; None when none was set."""
    return _SCOPE.get()


def enter(scope: Scope) -> contextvars.Token[Scope | None]:
    """Set the scope for the rest of the current task (an async route handler: its request)."""
    return _SCOPE.set(scope)


@contextmanager
def scoped(scope: Scope) -> Iterator[Scope]:
    """The scope while the block runs, the one before after it."""
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def carried(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` to run on another thread in the caller's context (its scope)."""
    ctx = contextvars.copy_context()
    return lambda: ctx.run(fn)
