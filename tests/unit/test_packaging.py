"""The wheel installs cwm_plugin and cwm_kernels (from kernels/) and no other top-level
module."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).parents[2]


def test_wheel_has_only_the_cwm_plugin_and_cwm_kernels_packages(tmp_path):
    # Build from a copy: setuptools leaves build/ and *.egg-info/ beside the sources it builds.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(src)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("cwm_plugin-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"cwm_plugin", "cwm_kernels",
                    next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert "cwm_kernels/blocks.py" in names
    # Every package folder in the source tree is in the wheel.
    for package, base in (("cwm_plugin", ROOT), ("cwm_kernels", ROOT / "kernels")):
        for init in (base / package).rglob("__init__.py"):
            rel = init.relative_to(base).as_posix()
            assert rel in names, f"{rel} is missing from the wheel"
    entry = [n for n in names if n.endswith("entry_points.txt")]
    assert entry and b"cwm = cwm_plugin.cli:main" in zipfile.ZipFile(wheel).read(entry[0])
