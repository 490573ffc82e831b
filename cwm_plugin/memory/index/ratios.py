"""The index's token counts turned into the served model's: one ratio a folder and tokenizer.

The index counts each line with its own tokenizer (``index_tokenizer``) when the line is
indexed; a selection budgets in the served model's tokens. Counting a first turn's hundreds of
candidate lines again with the served tokenizer would take a large part of the turn; instead a
line costs its index count times the ratio of the two tokenizers on the folder's own text,
measured once on a sample of lines counted both ways. The packer's costs are estimates
anyway: the assembled block is counted exactly, packed again with the room it left unused
and cut back should it be over, so the budget holds exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from cwm_plugin.memory.tokens import TokenCounter

SAMPLE = 256  # lines counted both ways to measure a ratio (the best-ranked: counted anyway)
MIN_SAMPLE = 32  # fewer lines than this: count exactly, measure on a later selection


class TokenRatios:
    """``ratios.of(folder, counter, lines)`` -> served tokens per index token, or None."""

    def __init__(self) -> None:
        self._ratios: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def of(self, folder: str, counter: TokenCounter,
           lines: Iterable[tuple[str, int]]) -> float | None:
        """The ratio for ``counter`` on ``folder``'s text, measured on ``lines`` (text, index
        count) the first time; None while there are too few lines to measure it."""
        key = (folder, counter.name)
        with self._lock:
            got = self._ratios.get(key)
        if got is not None:
            return got
        sample = []
        for text, n in lines:
            if n > 0:
                sample.append((text, n))
                if len(sample) >= SAMPLE:
                    break
        if len(sample) < MIN_SAMPLE:
            return None
        prefetch = getattr(counter, "count_many", None)
        if prefetch is not None:
            prefetch([t for t, _ in sample])
        ratio = sum(counter.count(t) for t, _ in sample) / sum(n for _, n in sample)
        with self._lock:
            self._ratios[key] = ratio
        return ratio

    def forget(self, folder: str) -> None:
        with self._lock:
            for key in [k for k in self._ratios if k[0] == folder]:
                del self._ratios[key]
