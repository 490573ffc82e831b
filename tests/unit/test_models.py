"""The offline model builder: cached by what it is built from, and reproducible."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from cwm_plugin.testing import models
from cwm_plugin.testing.models import TINY, build_random_model

pytestmark = pytest.mark.unit


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_second_build_is_the_cached_folder(tiny_model):
    assert build_random_model(TINY) == tiny_model
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_model / name).is_file(), name


def test_a_fresh_build_elsewhere_is_bit_identical(tiny_model, tmp_path, monkeypatch):
    # Tests on two machines (or after the cache is wiped) must serve the same model: same
    # trained tokenizer, same seeded weights.
    monkeypatch.setenv("CWM_MODEL_CACHE", str(tmp_path))
    fresh = build_random_model(TINY)
    assert fresh.parent == tmp_path
    for name in ("model.safetensors", "tokenizer.json"):
        assert _digest(fresh / name) == _digest(tiny_model / name), name


def test_the_cache_name_follows_the_training_text(monkeypatch):
    before = TINY.fingerprint()
    models.corpus_digest.cache_clear()
    monkeypatch.setattr(models, "training_texts", lambda: iter(["another corpus"]))
    try:
        assert TINY.fingerprint() != before
    finally:
        models.corpus_digest.cache_clear()


def test_the_model_is_the_same_whatever_lies_beside_the_checkout(tmp_path, monkeypatch):
    # Its tokenizer trains on the generated conversations alone: a folder of other text
    # beside the checkout (or pointed at) must not change what is built.
    before = TINY.fingerprint()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "1.json").write_text(json.dumps({
        "session_1_date_time": "1:00 pm on 8 May, 2023",
        "session_1": [{"speaker": "Zed", "dia_id": "D1:1", "text": "other text"}]}))
    monkeypatch.setenv("CWM_SHARED_DIR", str(tmp_path))
    models.corpus_digest.cache_clear()
    try:
        assert TINY.fingerprint() == before
        assert not any("Zed" in text for text in models.training_texts())
    finally:
        models.corpus_digest.cache_clear()
