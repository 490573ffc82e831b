"""Every route of the sidecar's OpenAPI schema fuzzed with schemathesis, through real HTTP with
real keys: ``cwm serve`` in its own process (so its memory can be watched) in front of
``cwm_plugin.testing.fake_upstream``, with memory, the activity log and a windows store on.

Each operation gets ``CWM_FUZZ_EXAMPLES`` examples (default 40) of valid data and as many of
invalid data (schemathesis's positive and negative modes), as acme (every grant) and as beta
(none). Checked for every answer: no 5xx, a status the schema declares, the declared content
type, a body that matches the declared schema. The process's resident memory after the whole
run stays within ``GROWTH_MIB`` of what it was after a first pass over every operation."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import httpx
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.specs.openapi.schemas import OpenApiSchema  # noqa: F401 - see below
from sidecar_helpers import KEYS, SECRET

from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.testing.sidecar_process import SidecarProcess

# schemathesis is imported here, at collection, with one thread running, and not lazily inside
# the test: pytest rewrites a plugin's modules as they are imported, and CPython 3.11.7's
# ast.parse keeps its recursion count per interpreter, so an import racing the servers' threads
# failed once in CI with "SystemError: AST constructor recursion depth mismatch" (CPython
# gh-106905, fixed in 3.11.8).
pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("CWM_FUZZ_EXAMPLES", "40"))
GROWTH_MIB = 48


def config(root: Path) -> Path:
    path = root / "sidecar.yaml"
    path.write_text(yaml.safe_dump({
        "tenants": [{"name": t, "key_sha256": [hash_key(KEYS[t])]} for t in ("acme", "beta")],
        "access": {"grants": {"acme": ["debug", "metrics", "admin"]}},
        "memory": {"root": str(root / "memory"), "tokenizer": "tiktoken:cl100k_base",
                   "embedder": {"kind": "hashing"}, "summary_every_turns": 0,
                   "extract_facts": False, "warm_on_start": False},
        "activity": {"root": str(root / "activity")},
        "windows": {"store": {"disk_path": str(root / "kv")}, "max_import_bytes": 1 << 20},
        "routing": {"health": {"interval_s": 0}},
        "max_body_bytes": 256 * 1024,
        # thousands of requests from two tenants: every route must be reached, not refused
        "rate_limits": {"rate_limit": "none", "token_quota": "none"},
    }))
    return path


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def fuzz(schema, base: str, examples: int, seen: Counter, failures: list[str]) -> None:
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]

    def runner(op, mode, tenant: str):
        auth = {"Authorization": f"Bearer {KEYS[tenant]}"}

        @settings(max_examples=examples, deadline=None, database=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case) -> None:
            resp = case.call(base_url=base, headers=auth, timeout=60)
            seen[resp.status_code] += 1
            try:
                case.validate_response(resp, checks=checks, headers=auth)
            except BaseExceptionGroup as exc:  # schemathesis's failures, collected
                failures.append(f"{op.label} {mode.value} {tenant}: HTTP "
                                f"{resp.status_code}: {str(exc)[:400]} {resp.request.method} "
                                f"{resp.request.url} {resp.text[:200]}")

        return run

    for result in schema.get_all_operations():
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            for tenant in ("acme", "beta"):
                try:
                    runner(result.ok(), mode, tenant)()
                except Unsatisfiable:  # nothing to make invalid (no parameters, no body)
                    continue


def test_every_route_fuzzed(tmp_path):
    fake = FakeUpstream(model="tiny", max_model_len=4096)
    with ServerThread(fake.app) as up, SidecarProcess(config(tmp_path), up.url, tmp_path,
                                                      SECRET) as srv:
        admin = {"Authorization": f"Bearer {KEYS['acme']}"}
        assert httpx.get(f"{srv.url}/openapi.json", timeout=30).status_code == 401
        raw = httpx.get(f"{srv.url}/openapi.json", headers=admin, timeout=30).json()
        schema = schemathesis.openapi.from_dict(raw)
        ops = {op.ok().label for op in schema.get_all_operations()}
        assert len(ops) >= 35, sorted(ops)
        seen: Counter = Counter()
        failures: list[str] = []
        fuzz(schema, srv.url, 5, seen, failures)  # a first pass: every path warmed up
        pid = srv._proc.pid  # noqa: SLF001 - the process under test
        warm = rss_mib(pid)
        fuzz(schema, srv.url, EXAMPLES, seen, failures)
        grown = rss_mib(pid) - warm
        total = sum(seen.values())
        print(f"fuzzed {len(ops)} operations, {total} requests, statuses {dict(seen)}, "
              f"RSS {warm:.0f} MiB after warm-up, +{grown:.1f} MiB after the run")
        kinds = sorted({f.split(": Schemathesis")[0].rsplit(": HTTP", 1)[0] + " | " +
                        " ".join(x.strip() for x in f.splitlines() if x.strip().startswith("- "))
                        for f in failures})
        assert not failures, "\n".join(kinds[:40]) + "\n\n" + "\n".join(failures[:5])
        assert total >= 2000 if EXAMPLES >= 40 else total > 0
        assert grown < GROWTH_MIB, f"RSS grew {grown:.1f} MiB over the run"
