"""``cwm memory`` through the real CLI entry point (hashing embedder, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cwm_plugin.cli import main
from cwm_plugin.memory.index.embeddings import HashingEmbedder
from cwm_plugin.memory.models import MemoryConfig
from cwm_plugin.memory.service.service import MemoryService

pytestmark = pytest.mark.unit


def test_cli_add_show_reindex_search(tmp_path: Path, counter, capsys) -> None:
    svc = MemoryService(MemoryConfig(root=tmp_path), HashingEmbedder(), counter)
    svc.record_turn("acme", "s1", "user", "We planted basil and mint on the balcony.",
                    turn_id="t1")
    svc.close()
    common = ["--root", str(tmp_path), "--embedder", "hashing"]
    assert main(["memory", "add", *common, "--folder", "acme", "--category", "preference",
                 "The user likes mint tea."]) == 0
    assert main(["memory", "reindex", *common]) == 0
    assert "1 chunks indexed" in capsys.readouterr().out
    assert main(["memory", "search", *common, "--folder", "acme", "balcony basil"]) == 0
    assert "turns t1" in capsys.readouterr().out
    assert main(["memory", "search", *common, "--tenant", "acme", "balcony basil"]) == 0
    assert "turns t1" in capsys.readouterr().out  # --tenant: another name for --folder
    assert main(["memory", "show", "--root", str(tmp_path), "--folder", "acme"]) == 0
    out = capsys.readouterr().out
    assert "s1" in out and "mint tea" in out
    assert main(["memory", "show", "--root", str(tmp_path), "--folder", "acme",
                 "--session", "s1"]) == 0
    assert "t1 user: We planted basil" in capsys.readouterr().out
    assert main(["memory", "search", *common, "--folder", "../x", "q"]) == 2
    assert "invalid_input" in capsys.readouterr().err


def test_cli_takes_search_settings_from_the_sidecar_config_and_flags(tmp_path: Path,
                                                                    monkeypatch) -> None:
    import argparse

    from cwm_plugin.memory import cli

    config = tmp_path / "sidecar.yaml"
    config.write_text("memory:\n  root: mem\n  embedder: {kind: hashing}\n  chunk_tokens: 150\n"
                      "  search: {bm25_weight: 0.9, vector_weight: 0.1, mmr_lambda: 0.5}\n")
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli.register(sub)
    args = parser.parse_args(["memory", "search", "--config", str(config), "--folder", "a",
                              "--vector-weight", "0.3", "--recency-half-life-days", "7", "q"])
    svc = cli._service(args)
    c = svc.config
    assert c.root == (tmp_path / "mem").resolve() and c.chunk_tokens == 150
    assert (c.bm25_weight, c.vector_weight, c.mmr_lambda, c.recency_half_life_days) == \
        (0.9, 0.3, 0.5, 7.0)  # the flag wins over the file
    svc.close()
    args = parser.parse_args(["memory", "reindex", "--embedder", "hashing"])
    with pytest.raises(Exception, match="no memory root"):
        cli._service(args)


@pytest.mark.parametrize("cmd", ["reindex", "import", "search", "add", "check", "show"])
def test_every_command_names_a_memory_folder_with_folder(cmd: str, capsys) -> None:
    """``--folder`` is the flag the help shows; ``--tenant`` stays its other name."""
    with pytest.raises(SystemExit):
        main(["memory", cmd, "--help"])
    out = capsys.readouterr().out
    assert "--folder FOLDER, --tenant FOLDER" in out and "--tenant FOLDER, --folder" not in out
