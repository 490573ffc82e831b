"""``cwm store usage|verify|gc`` through the real CLI entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from cwm_plugin.cli import main

pytestmark = pytest.mark.unit


def test_store_cli(tmp_path, make_store, kv_block, capsys, monkeypatch):
    # in this process: the test run must not lower its own priority (a subprocess checks it)
    monkeypatch.setattr("cwm_plugin.store.cli.MAINTENANCE_NICE", 0)
    root = tmp_path / "d"
    s = make_store(disk_path=str(root))
    for i in range(3):
        s.put(f"k{i}".encode(), kv_block(i)).result()
    # an index rebuild that found a blob whose key was saved again meanwhile: unreferenced
    s.disk.index.insert_rebuilt([("ab" * 20, 6, b"k0", time.time())])
    s.close()
    assert main(["store", "usage", "--disk-path", str(root), "--json"]) == 0
    usage = json.loads(capsys.readouterr().out)
    assert usage["disk"]["blobs"] == 4
    cfg = tmp_path / "store.yaml"
    cfg.write_text(f"store:\n  disk_path: {root}\n")
    assert main(["store", "gc", "--config", str(cfg)]) == 0
    assert "disk: 0" in capsys.readouterr().out           # too young: may be mid-save
    assert main(["store", "gc", "--config", str(cfg), "--min-age", "0"]) == 0
    assert "disk: 1" in capsys.readouterr().out
    assert main(["store", "verify", "--disk-path", str(root), "--no-progress"]) == 0
    assert "3 ok" in capsys.readouterr().out
    blob = next(p for p in (root / "blobs").glob("*/*/*"))
    data = bytearray(blob.read_bytes())
    data[-2] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert main(["store", "verify", "--disk-path", str(root), "--no-progress"]) == 2
    assert "1 corrupt" in capsys.readouterr().out


def test_store_cli_needs_a_store(capsys):
    assert main(["store", "usage"]) == 2
    assert "config_error" in capsys.readouterr().err


def test_maintenance_yields_the_cores_to_serving(tmp_path):
    """``cwm store gc`` (and usage, verify) run at nice +10, in SCHED_IDLE and at the lowest
    best-effort I/O priority unless told otherwise: a gc loop at normal priority took a core
    from vLLM. gc and usage never import torch (2 s of CPU a run, which slowed serving even
    at idle priority): they read no payload."""
    probe = ("import os, psutil, sys; from cwm_plugin.cli import main; "
             "import cwm_plugin.store.cli as c; seen = {}; "
             "orig = c.yield_to_serving; "
             "c.yield_to_serving = lambda n: (orig(n), seen.update(nice=os.nice(0), "
             "io=tuple(psutil.Process().ionice()), idle=os.sched_getscheduler(0) == os.SCHED_IDLE, "
             "torch='torch' in sys.modules))[0]; "
             "main(sys.argv[1:]); print(seen['torch'] or 'torch' in sys.modules, seen['nice'], "
             "seen['io'][0] == psutil.IOPRIO_CLASS_BE, seen['io'][1], seen['idle'])")
    root = str(tmp_path / "d")
    base = os.nice(0)
    out = subprocess.run([sys.executable, "-c", probe, "store", "gc", "--disk-path", root,
                          "--json"], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-5:] == ["False", str(min(base + 10, 19)), "True", "7",
                                       "True"], out.stderr
    out = subprocess.run([sys.executable, "-c", probe, "store", "usage", "--disk-path", root,
                          "--nice", "0"], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split()[-4::3] == [str(base), "False"], out.stderr


def collects_one(proc: subprocess.Popen, why: str) -> None:
    """Read ``gc --every`` reports until a pass removes one blob (30 s at most)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if json.loads(proc.stdout.readline())["removed_blobs"]["disk"] == 1:
            return
    pytest.fail(why)


def test_gc_every_keeps_collecting_in_one_process_until_sigterm(tmp_path, make_store, kv_block):
    """``gc --every``: one long-lived process (no interpreter start a run, the bulk of a run's
    CPU), a report a pass, blobs that become garbage while it runs are collected, SIGTERM ends
    it cleanly."""
    root = tmp_path / "d"
    s = make_store(disk_path=str(root))
    s.put(b"k0", kv_block(0)).result()
    s.close()
    proc = subprocess.Popen([sys.executable, "-m", "cwm_plugin.cli", "store", "gc",
                             "--disk-path", str(root), "--min-age", "0", "--json",
                             "--every", "0.2", "--nice", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())
        assert first["removed_blobs"] == {"disk": 0} and first["seconds"] >= 0
        s = make_store(disk_path=str(root))           # garbage appears while it runs
        s.disk.index.insert_rebuilt([("cd" * 20, 6, b"k0", time.time())])
        s.close()
        collects_one(proc, "the running gc never collected the new garbage")
        # a pass that fails (its temp folder gone: an OSError) is logged and the next one
        # runs; with the folder back, passes report again and nothing was deleted meanwhile
        (root / "tmp").rename(root / "tmp-away")
        time.sleep(1.0)
        (root / "tmp-away").rename(root / "tmp")
        assert proc.poll() is None                    # still running
        s = make_store(disk_path=str(root))           # new garbage: a pass after it collects
        s.disk.index.insert_rebuilt([("ef" * 20, 6, b"k0", time.time())])
        s.close()
        collects_one(proc, "gc did not go on after a failed pass")
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "gc: this pass failed" in err and "the next one runs" in err, err
    s = make_store(disk_path=str(root))
    assert s.contains_many([b"k0"]) == [True]        # the live block is still served
    s.close()


def test_gc_every_refuses_a_period_that_is_not_positive(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["store", "gc", "--disk-path", "/nowhere", "--every", "0"])
    assert exc.value.code == 2 and "above 0" in capsys.readouterr().err
