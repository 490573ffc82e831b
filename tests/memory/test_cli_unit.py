"""``cwm memory`` through the real CLI entry point (hashing embedder, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cwm_plugin.cli import main
from cwm_plugin.memory.embeddings import HashingEmbedder
from cwm_plugin.memory.models import MemoryConfig
from cwm_plugin.memory.service import MemoryService

pytestmark = pytest.mark.unit


def test_cli_add_show_reindex_search(tmp_path: Path, counter, capsys) -> None:
    svc = MemoryService(MemoryConfig(root=tmp_path), HashingEmbedder(), counter)
    svc.record_turn("acme", "s1", "user", "We planted basil and mint on the balcony.",
                    turn_id="t1")
    svc.close()
    common = ["--root", str(tmp_path), "--embedder", "hashing"]
    assert main(["memory", "add", *common, "--tenant", "acme", "--category", "preference",
                 "The user likes mint tea."]) == 0
    assert main(["memory", "reindex", *common]) == 0
    assert "1 chunks indexed" in capsys.readouterr().out
    assert main(["memory", "search", *common, "--tenant", "acme", "balcony basil"]) == 0
    assert "turns t1" in capsys.readouterr().out
    assert main(["memory", "show", "--root", str(tmp_path), "--tenant", "acme"]) == 0
    out = capsys.readouterr().out
    assert "s1" in out and "mint tea" in out
    assert main(["memory", "show", "--root", str(tmp_path), "--tenant", "acme",
                 "--session", "s1"]) == 0
    assert "t1 user: We planted basil" in capsys.readouterr().out
    assert main(["memory", "search", *common, "--tenant", "../x", "q"]) == 2
    assert "invalid_input" in capsys.readouterr().err
