"""The house's layering: import-linter's contracts hold (pyproject's ``[tool.importlinter]``:
the layers, no package importing one above it, no import circle at any depth), and each
package's command line reads its own settings and derives its own salts without importing the
sidecar above it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).parents[2]

def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


RUN = """
import sys
from cwm_plugin.cli import main
for argv in sys.argv[1:]:
    assert main(argv.split("|")) == 0, argv
# the sidecar's own group (cwm serve) registers its flags; nothing else of it may load
print(sorted(m for m in sys.modules
             if m.startswith("cwm_plugin.sidecar.") and m != "cwm_plugin.sidecar.cli"))
"""


def test_package_clis_read_their_own_settings_without_the_sidecar(tmp_path):
    config = tmp_path / "sidecar.yaml"
    config.write_text("memory:\n  root: mem\n  embedder: {kind: hashing}\n"
                      "activity:\n  root: act\n")
    (tmp_path / "act").mkdir()
    store = tmp_path / "store.yaml"
    store.write_text(f"disk_path: {tmp_path / 'kv'}\n")
    env = {**os.environ, "CWM_SIDECAR_SECRET": "s" * 32}
    out = subprocess.run(
        [sys.executable, "-c", RUN,
         f"memory|search|--config|{config}|--folder|acme|anything",
         f"activity|show|--config|{config}",
         f"window|ls|--store|{store}|--tenant|acme"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
