"""What this process keeps of one tenant's windows, apart from every other tenant's: its lock,
the bytes its live windows pin (a running total) and the users whose former layout it looked
at.

* **The pinned total** is derived from the tenant's manifests the first time this process
  needs it (its first commit or count after the start) and then kept: a claim adds its
  window, a drop (a delete, an expiry) takes it back. Entries are by window salt, so a window
  claimed again under another name (a rename, a move) or dropped twice (a delete racing an
  expiry) counts once. It is derived again when it would refuse a commit (a window that
  expired in the store unseen, or was deleted by another process, no longer counts) and when
  it is older than ``RESCAN_S`` (windows other processes sharing the store committed).
* **The users looked at** (:meth:`TenantState.remember`): at most ``limit`` of them, the
  newest kept, so one tenant's users never push out another tenant's.

Every method is called holding the tenant's ``lock``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from cwm_plugin.windows.model import Manifest

RESCAN_S = 60.0  # the pinned total is derived again from the store at least this often


@dataclass
class TenantState:
    """One tenant's lock, pinned total and users looked at (see the module docstring)."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    users: OrderedDict[str, None] = field(default_factory=OrderedDict)
    windows: dict[str, int] | None = None   # window salt -> bytes (None: not derived yet)
    total: int = 0
    derived: float = 0.0                    # time.monotonic() of the last derivation

    def stale(self) -> bool:
        """Whether the pinned total must be derived from the store (first, or again)."""
        return self.windows is None or time.monotonic() - self.derived > RESCAN_S

    def derive(self, live: Iterable[Manifest]) -> None:
        """Take the tenant's live windows, as read from the store, for the pinned total."""
        self.windows = {m.window_salt: m.stored_bytes for m in live}
        self.total = sum(self.windows.values())
        self.derived = time.monotonic()

    def add(self, m: Manifest) -> None:
        """Window ``m`` is claimed (once derived; the derivation reads it otherwise)."""
        if self.windows is not None:
            self.total += m.stored_bytes - self.windows.get(m.window_salt, 0)
            self.windows[m.window_salt] = m.stored_bytes

    def remove(self, m: Manifest) -> None:
        """Window ``m`` is dropped."""
        if self.windows is not None:
            self.total -= self.windows.pop(m.window_salt, 0)

    def remember(self, user: str, limit: int) -> None:
        """User ``user``'s former layout is looked at (the newest ``limit`` users kept)."""
        self.users[user] = None
        self.users.move_to_end(user)
        while len(self.users) > limit:
            self.users.popitem(last=False)
