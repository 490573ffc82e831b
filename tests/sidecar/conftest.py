"""Fixtures for the sidecar tests: one recording relay and sidecars on loopback per module."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sidecar_helpers import Recorder, make_settings

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.testing.vllm_server import VLLMServer, cwm_connector_args


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    """The module's KV store folder: vLLM's connector writes it, the sidecar's windows read it."""
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def kv_vllm(tiny_model, store_dir, tmp_path_factory) -> Iterator[VLLMServer]:
    """The tiny model served by vLLM with the cwm connector on ``store_dir``."""
    server = VLLMServer(model_dir=tiny_model, log_dir=tmp_path_factory.mktemp("vllm"),
                        extra_args=cwm_connector_args({"disk_path": str(store_dir)}))
    with server:
        yield server


@pytest.fixture(scope="module")
def recorder(tiny_vllm) -> Iterator[tuple[Recorder, ServerThread]]:
    rec = Recorder(tiny_vllm.base_url)
    with ServerThread(rec.app) as srv:
        yield rec, srv


@pytest.fixture(scope="module")
def sidecar_factory(tiny_model, tmp_path_factory) -> Iterator[Callable[..., ServerThread]]:
    """``make(upstream_url, root=None, **settings_overrides) -> running ServerThread``."""
    started: list[ServerThread] = []

    def make(upstream: str, root: Path | None = None, **over: Any) -> ServerThread:
        root = root or tmp_path_factory.mktemp("memory")
        app = create_app(make_settings(upstream, root, tiny_model, **over))
        srv = ServerThread(app).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def sidecar(recorder, sidecar_factory) -> ServerThread:
    """The module's main sidecar: memory on, cache-aware, upstream = recorder -> vLLM."""
    return sidecar_factory(recorder[1].url)


@pytest.fixture(scope="module")
def fake_upstream() -> Iterator[tuple[FakeUpstream, ServerThread]]:
    """A fake vLLM (``cwm_plugin.testing.fake_upstream``: ``tiny``, 4,096 tokens) on loopback."""
    fake = FakeUpstream(model="tiny", max_model_len=4096)
    with ServerThread(fake.app) as srv:
        yield fake, srv
