"""bench/ttft.py's --store option: each KEY=VALUE a store setting for our servers, its value
read as YAML; a malformed one is a usage error naming it."""

from __future__ import annotations

import argparse

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def ttft(bench_module):
    return bench_module("ttft")


def test_store_settings_are_read_as_yaml(ttft):
    ap = argparse.ArgumentParser()
    got = ttft.store_settings(ap, ["zstd_level=0", "memory_compress=true", "disk_bytes=2G",
                                   "redis_url=redis://h:1/0"])
    assert got == {"zstd_level": 0, "memory_compress": True, "disk_bytes": "2G",
                   "redis_url": "redis://h:1/0"}
    assert ttft.store_settings(ap, []) == {}


@pytest.mark.parametrize("bad", ["zstd_level", "=0"])
def test_a_setting_without_key_or_value_is_a_usage_error(ttft, bad, capsys):
    with pytest.raises(SystemExit):
        ttft.store_settings(argparse.ArgumentParser(prog="ttft.py"), [bad])
    assert bad in capsys.readouterr().err
