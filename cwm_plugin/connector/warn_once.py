"""Log each kind of trouble once per connector object: the engine's step may meet the same
failing store thousands of times, and the counters, not the log, say how often."""

from __future__ import annotations

import logging
import threading


class WarnOnce:
    """``warn(tag, msg, *args)``: a warning the first time ``tag`` is seen, silence after."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tag: str, msg: str, *args: object) -> None:
        with self._lock:
            if tag in self._seen:
                return
            self._seen.add(tag)
        self._log.warning("cwm connector: " + msg, *args)
