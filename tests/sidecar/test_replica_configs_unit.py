"""The replicas' deployment files (``configs/replicas/``) are what they say: the sidecar's
file loads into a replica that keeps nothing alone, and nginx accepts its file."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cwm_plugin.sidecar.settings import load_settings

pytestmark = pytest.mark.unit
REPLICAS = Path(__file__).resolve().parents[2] / "configs" / "replicas"


def test_the_replica_config_shares_everything(monkeypatch) -> None:
    monkeypatch.setenv("CWM_SIDECAR_SECRET", "x" * 32)
    monkeypatch.setenv("CWM_POSTGRES_URL", "postgresql://cwm:pw@db:5432/cwm")
    s = load_settings(REPLICAS / "sidecar.yaml")
    assert s.memory.backend == "postgres" and s.memory.postgres_url is not None
    assert s.sessions.shared_url is not None
    assert s.rate_limits.storage.startswith("redis://")
    assert s.windows is not None and s.windows.store
    assert len(s.endpoints()) == 2


@pytest.mark.skipif(shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
                    reason="nginx is not installed (scripts/setup.sh installs it)")
@pytest.mark.skipif(os.geteuid() != 0, reason="nginx -t opens its default log as root")
def test_nginx_accepts_the_balancer_config(tmp_path: Path) -> None:
    exe = shutil.which("nginx") or "/usr/sbin/nginx"
    conf = tmp_path / "nginx.conf"
    conf.write_text((REPLICAS / "nginx.conf").read_text().replace("listen 80;",
                                                                   "listen 127.0.0.1:18080;"))
    r = subprocess.run([exe, "-t", "-c", str(conf), "-p", str(tmp_path),
                        "-g", f"pid {tmp_path}/nginx.pid; error_log {tmp_path}/e.log;"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
