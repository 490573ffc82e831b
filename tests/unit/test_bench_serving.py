"""bench/serving.py's pieces without vLLM: the workload generator on fake text and a fake
tokenizer, the runner against a fake streaming OpenAI client (schedule, token times, failures,
history), the statistics, the sweep's measure, the goals and tables, the sizing and the TCP
proxy process's black hole. Structure only: nothing here asserts a speed."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def mods(bench_module):
    return SimpleNamespace(**{n: bench_module(f"_serving_{n}")
                              for n in ("workload", "report", "configs", "faults",
                                        "cluster")})


class WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(w) for w in text.split()]


LINES = [f"{'Ann' if i % 2 else 'Bo'}: line {i} about trains and weather" for i in range(400)]


class FakeStream:
    def __init__(self, tokens: int, prompt: int) -> None:
        self.tokens, self.prompt = tokens, prompt

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        def chunk(content, done, choices=True):
            usage = SimpleNamespace(prompt_tokens=self.prompt, completion_tokens=done)
            ch = [SimpleNamespace(delta=SimpleNamespace(content=content))] if choices else []
            return SimpleNamespace(choices=ch, usage=usage)
        yield chunk("", 0)
        for i in range(self.tokens):
            await asyncio.sleep(0.001)
            yield chunk(f"w{i} ", i + 1)
        yield chunk(None, self.tokens, choices=False)


class FakeClient:
    def __init__(self, fail_user: str | None = None) -> None:
        self.calls: list[dict] = []
        self.fail_user = fail_user
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **kw):
        self.calls.append(kw)
        salt = kw["extra_body"].get("cache_salt", "")
        if self.fail_user and salt.endswith(self.fail_user):
            raise ConnectionError("upstream gone")
        return FakeStream(kw["max_tokens"], sum(len(m["content"]) for m in kw["messages"]))


def test_sessions_share_the_system_prompt_and_have_contexts_and_salts_of_their_own(mods):
    spec = mods.workload.WorkloadSpec(users=3, system_tokens=21, context_tokens=42)
    a = mods.workload.build_sessions(spec, WordTokenizer(), LINES, ["Q1?", "Q2?"], tag="x")
    b = mods.workload.build_sessions(spec, WordTokenizer(), LINES, ["Q1?", "Q2?"], tag="y")
    assert len(a) == 3 and len({s.messages[0]["content"] for s in a + b}) == 1
    assert len({s.context for s in a}) == 3 and [s.context for s in a] == [s.context for s in b]
    assert len({s.salt for s in a + b}) == 6
    first = a[0].next_messages()
    assert first[-1]["content"].startswith(a[0].context) and first[0]["role"] == "system"
    assert not any(line in a[0].messages[0]["content"] for line in a[0].context.split("\n"))


def test_the_runner_streams_every_round_and_records_tokens_failures_and_history(mods):
    w = mods.workload
    spec = w.WorkloadSpec(users=3, rounds=2, answer_tokens=4, system_tokens=21,
                          context_tokens=42, qps=200.0)
    sessions = w.build_sessions(spec, WordTokenizer(), LINES, ["Q1?", "Q2?"], tag="t")
    client = FakeClient(fail_user="u2")
    seen = []
    reqs = asyncio.run(w.Runner(client, "m", spec, on_done=seen.append).run(sessions, 2, "p"))
    assert len(reqs) == len(seen) == 6 and [r.sent for r in reqs] == sorted(r.sent for r in reqs)
    ok = [r for r in reqs if r.ok]
    assert len(ok) == 4 and all(r.user != "t-u2" for r in ok)
    assert all(len(r.token_times) == 4 and r.ttft > 0 and len(r.itls) == 3 for r in ok)
    assert {r.round for r in ok} == {0, 1} and all(r.returning == (r.round == 1) for r in reqs)
    assert sessions[0].turns == 2 and len(sessions[0].messages) == 5    # sys + 2 x (q, a)
    assert sessions[2].turns == 2 and len(sessions[2].messages) == 1    # failed: nothing kept
    kw = client.calls[0]
    assert kw["stream"] and kw["temperature"] == 0.0 and kw["extra_body"]["ignore_eos"]
    assert kw["stream_options"]["continuous_usage_stats"]

    s = mods.report.summarize(reqs)
    assert set(mods.report.KEYS) <= set(s) and s["failed_requests"] == 2
    assert s["requests"] == 6 and s["requests_per_s"] > 0 and s["ttft_p50_s"] > 0
    assert s["errors"] == {"ConnectionError: upstream gone": 2}
    line = mods.report.timeline(reqs)
    assert len(line) == 6 and line[0][2] == 0.0 and {x[4] for x in line} == {0, 4}
    med = mods.report.median_of([s, s])
    assert med["failed_requests"] == 4 and med["ttft_p95_s"] == s["ttft_p95_s"]
    assert not any("priority" in c["extra_body"] for c in client.calls)


def test_returning_rounds_go_ahead_where_vllm_schedules_by_priority(mods, tmp_path):
    w = mods.workload
    spec = w.WorkloadSpec(users=2, rounds=3, answer_tokens=2, system_tokens=21,
                          context_tokens=42, qps=200.0)
    sessions = w.build_sessions(spec, WordTokenizer(), LINES, ["Q1?", "Q2?"], tag="t")
    client = FakeClient()
    asyncio.run(w.Runner(client, "m", spec, returning_priority=-1).run(sessions, 3, "p"))
    firsts = [c for c in client.calls if len(c["messages"]) == 2]      # system + question
    assert len(firsts) == 2 and not any("priority" in c["extra_body"] for c in firsts)
    later = [c for c in client.calls if len(c["messages"]) > 2]
    assert len(later) == 4 and all(c["extra_body"]["priority"] == -1 for c in later)
    c = mods.configs
    sizes = c.Sizes(users=10, user_tokens=1200, kv_bytes_per_token=23040, fraction=0.33,
                    max_model_len=2048)
    servers = c.Servers(tmp_path, "bfloat16", sizes, tmp_path, 10)
    prio, plain = servers.cwm_args("cwm_cpu_priority"), servers.cwm_args("cwm_cpu")
    assert prio[-2:] == ["--scheduling-policy", "priority"] and prio[:-2] == plain
    assert c.RETURNING_PRIORITY == {"cwm_cpu_priority": -1}


def test_itl_while_prefill_keeps_only_gaps_overlapping_another_users_wait(mods):
    R = mods.workload.Request
    a = R("p", "a", 0, sent=0.0, token_times=[1.0, 1.1, 3.0, 3.1])
    b = R("p", "b", 1, sent=2.0, token_times=[2.9, 3.0])    # returning: waits 2.0..2.9
    assert mods.report.itl_while_prefill([a, b]) == pytest.approx([1.9])
    # a first turn's cold prefill (no KV anywhere yet, in any config) overlapping the gap
    # takes it out: that stall is the workload's arrivals, not a restore's cost
    c = R("p", "c", 0, sent=1.5, token_times=[2.5])
    assert mods.report.itl_while_prefill([a, b, c]) == []
    late = R("p", "c", 0, sent=3.05, token_times=[3.2])   # after the gap: it stays
    assert mods.report.itl_while_prefill([a, b, late]) == pytest.approx([1.9])


def test_the_sweep_goals_and_tables(mods):
    rep = mods.report
    pts = {2: {"returning_ttft_p95_s": 0.1}, 4: {"returning_ttft_p95_s": 0.3},
           8: {"returning_ttft_p95_s": 0.2}}
    assert rep.most_users_within(pts, 0.25) == 2 and rep.most_users_within(pts, 1.0) == 8
    assert rep.most_users_within({2: {"returning_ttft_p95_s": math.nan}}, 1.0) == 0
    base = {k: 1.0 for k in rep.KEYS}
    configs = {"vllm": {**base, "returning_ttft_p95_s": 2.0, "requests_per_s": 0.5},
               "lmcache": {**base, "returning_ttft_p95_s": 0.8},
               "cwm_cpu": {**base, "returning_ttft_p95_s": 0.3, "requests_per_s": 1.5}}
    faults = {"redis_restart": {**base, "failed_requests": 0, "itl_p99_s": 0.5,
                                "baseline_itl_p99_s": 0.2}}
    g = rep.goals(configs, {**base, "itl_while_prefill_p99_s": 1.0}, faults)
    assert g["returning_ttft_p95_cwm_cpu_vs_vllm"] == {"value": 0.15, "goal": "<= 0.2",
                                                       "met": True}
    assert g["peak_requests_per_s_cwm_cpu_vs_vllm"]["met"] is True
    assert g["peak_requests_per_s_cwm_cpu_vs_lmcache"]["met"] is True
    assert g["fault_redis_restart_itl_p99_vs_baseline"]["met"] is False
    assert g["fault_redis_restart_failed_requests"]["met"] is True
    assert "0.15" in rep.config_table(configs, {**base})
    assert "most users" in rep.sweep_table({"vllm": pts}, 0.25)
    assert "redis_restart" in rep.fault_table(faults) and "MISSED" in rep.goal_lines(g)


def test_sizes_follow_the_model_config_and_the_shipped_redis_config(mods, tmp_path):
    c = mods.configs
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576, "head_dim": 64}))
    bpt = c.kv_bytes_per_token(tmp_path, "bfloat16")
    assert bpt == 23040 and c.kv_bytes_per_token(tmp_path, "float32") == 2 * bpt
    sizes = c.Sizes(users=10, user_tokens=1200, kv_bytes_per_token=bpt, fraction=0.33,
                    max_model_len=2048)
    assert sizes.user_blocks == 10 and sizes.vllm_blocks == 33
    assert 0.25 <= sizes.as_dict()["fraction_fitting"] <= 0.5
    assert sizes.fits_blocks(10) > 10 * sizes.user_blocks
    extra = c.shipped_redis("redis://h:1/0", tmp_path / "d", memory_bytes=5)
    assert extra["store"]["redis_write"] == "behind" and extra["store"]["memory_bytes"] == 5
    assert extra["store"]["redis_url"] == "redis://h:1/0" and extra["salted_only"] is True
    args = c.connector_args(extra)
    assert json.loads(args[1])["kv_connector_extra_config"]["store"]["disk_path"]
    # --store: settings over every one of our configs' own (a run with raw blobs)
    servers = c.Servers(tmp_path, "bfloat16", sizes, tmp_path, 10,
                        store_override={"zstd_level": 0})
    for name in ("cwm_cpu", "cwm_disk", "cwm_redis"):
        store = json.loads(servers.cwm_args(name, "redis://h:1/0")[1])[
            "kv_connector_extra_config"]["store"]
        assert store["zstd_level"] == 0, name
    # every config's vLLM gets the same scheduler settings; the prefill cap only when asked
    args = list(servers.vllm([]).extra_args)
    assert args[args.index("--max-num-batched-tokens") + 1] == "2048"
    assert "--long-prefill-token-threshold" not in args
    capped = c.Servers(tmp_path, "bfloat16", sizes, tmp_path, 10, 128,
                       long_prefill_token_threshold=32).vllm(["--x"]).extra_args
    assert capped[capped.index("--long-prefill-token-threshold") + 1] == "32"
    assert capped[-1] == "--x"


def test_the_proxy_process_relays_and_holds_everything_while_black_holed(mods):
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data)
    threading.Thread(target=echo, daemon=True).start()
    with mods.faults.ProxyProcess(port) as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as c:
        c.sendall(b"ping")
        assert c.recv(16) == b"ping"
        proxy.black_hole(True)
        c.sendall(b"held")
        c.settimeout(0.3)
        with pytest.raises(TimeoutError):
            c.recv(16)
        proxy.black_hole(False)
        c.settimeout(2)
        assert c.recv(16) == b"held"
    srv.close()


def test_fault_helpers_write_configs_and_count_each_masters_share(mods, tmp_path):
    f = mods.faults
    cfg = f.store_yaml(tmp_path / "s.yaml", {"disk_path": "/d", "redis_url": "redis://x/0",
                                              "encryption_key": None})
    import yaml
    assert yaml.safe_load(cfg.read_text()) == {"store": {"disk_path": "/d",
                                                         "redis_url": "redis://x/0"}}
    sc = yaml.safe_load(f.sidecar_yaml(tmp_path / "sc.yaml", tmp_path, {"a": "http://a",
                                                                        "b": "http://b"},
                                       "ab" * 32, "m").read_text())
    assert [u["name"] for u in sc["upstreams"]] == ["a", "b"] and not sc["memory_enabled"]
    got = mods.cluster.shares({1: 10, 2: 10, 3: 10}, {1: 41, 2: 21, 3: 41})
    assert got["commands"] == {"1": 30, "2": 10, "3": 30} and got["max_share"] == 0.429

    calls = []

    async def go():
        spec = mods.workload.WorkloadSpec(users=2, rounds=1, answer_tokens=2,
                                          system_tokens=21, context_tokens=42, qps=100.0)
        ss = mods.workload.build_sessions(spec, WordTokenizer(), LINES, ["Q?"], tag="f")
        runner = mods.workload.Runner(FakeClient(), "m", spec)
        return await f.round_with(runner, ss, 2, "fault", lambda done: calls.append(1), 0.0)
    assert len(asyncio.run(go())) == 4 and calls == [1]
