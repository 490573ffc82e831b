"""The README's quickstart and the docs' commands work with the shipped code and configs."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

import pytest

from cwm_plugin.cli import build_parser
from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.sidecar.settings import load_settings
from cwm_plugin.store.config import StoreConfig

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart"
QUICKSTART_KEY = "sk-cwm-quickstart"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_quickstart_pair_shares_one_store_and_a_key_the_readme_names() -> None:
    connector = json.loads((QUICKSTART / "connector.json").read_text())
    store = StoreConfig.from_dict(
        ConnectorConfig.from_extra_config(connector["kv_connector_extra_config"]).store)
    settings = load_settings(QUICKSTART / "sidecar.yaml")
    assert settings.windows is not None, "the quickstart freezes and thaws windows"
    assert StoreConfig.from_dict(settings.windows.store).disk_path == store.disk_path
    digest = hashlib.sha256(QUICKSTART_KEY.encode()).hexdigest()
    assert [digest] == [h for t in settings.tenants for h in t.key_sha256]
    assert QUICKSTART_KEY in (ROOT / "README.md").read_text()


def test_the_quickstart_writes_only_where_any_user_may() -> None:
    """A non-root user can run it: nothing under /var/lib, everything in one temp folder."""
    connector = json.loads((QUICKSTART / "connector.json").read_text())
    settings = load_settings(QUICKSTART / "sidecar.yaml")
    paths = [connector["kv_connector_extra_config"]["store"]["disk_path"],
             str(settings.memory.root)]
    assert all(p.startswith("/tmp/cwm-quickstart/") for p in paths), paths


def cwm_commands(text: str) -> list[str]:
    """Every ``cwm ...`` command in the fenced shell blocks of a markdown text."""
    found = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line)
            found += [m.strip() for m in
                      re.findall(r"(?:^|[\s(;&|])cwm\s+([^;&|)]+)", line)]
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cwm_command_in_the_docs_parses(doc: Path) -> None:
    parser = build_parser()
    commands = cwm_commands(doc.read_text())
    for command in commands:
        argv = shlex.split(command)
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{doc.name}: `cwm {command}` does not parse")


def test_cwm_model_prints_the_answer_alone_on_stdout(capsys: pytest.CaptureFixture) -> None:
    """``MODEL=$(cwm model ...)`` and ``DTYPE=$(cwm model dtype)`` in the README read stdout."""
    from cwm_plugin.cli import main
    from cwm_plugin.compute_dtype import compute_dtype

    assert main(["model", "dtype"]) == 0
    assert capsys.readouterr().out == compute_dtype() + "\n"
