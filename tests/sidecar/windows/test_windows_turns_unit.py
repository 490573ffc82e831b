"""Which turn a freeze takes, and how long window routes make anyone wait, over real HTTP: the
sidecar in front of an upstream that answers like vLLM with the cwm connector (it leaves each
salted request's context record in a real disk store, written as the connector writes it),
holding a request back where a test needs a turn to finish late or stay in flight."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from sidecar_helpers import KEYS, make_settings, runtime, salt

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.turn.plan import digest
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.windows.conversation import ConversationRecords

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from window_helpers import BS, converse  # noqa: E402

pytestmark = pytest.mark.unit
ACME = {"Authorization": f"Bearer {KEYS['acme']}"}
BETA = {"Authorization": f"Bearer {KEYS['beta']}"}


class Engine:
    """vLLM with the cwm connector as windows see it: chats, completions and responses are
    answered, and each salted request leaves its blocks and context record (``converse``:
    the connector's write); a request is held back while ``hold(body)`` is true."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.hold: Callable[[dict[str, Any]], bool] = lambda body: False
        self.records: Callable[[dict[str, Any]], bool] = lambda body: True  # (too short: none)
        self.received: list[dict[str, Any]] = []
        self.app = FastAPI()

        @self.app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"data": [{"id": "tiny", "max_model_len": 4096}]})

        @self.app.post("/v1/{path:path}")
        async def answer(path: str, request: Request) -> JSONResponse:
            body = await request.json()
            self.received.append(body)
            while self.hold(body):
                await asyncio.sleep(0.02)
            cwm = (body.get("kv_transfer_params") or {}).get("cwm") or {}
            turn = cwm.get("turn")
            if self.records(body):
                await asyncio.to_thread(converse, self.store, body["cache_salt"],
                                        BS * (turn or 1) + 3, turn=turn,
                                        keep=cwm.get("keep", 8), at=cwm.get("at"),
                                        seed=turn or 0)
            usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
            if path == "chat/completions":
                return JSONResponse({"id": "c", "object": "chat.completion", "usage": usage,
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant",
                                                              "content": "ok"}}]})
            if path == "completions":
                return JSONResponse({"id": "c", "object": "text_completion", "usage": usage,
                                     "choices": [{"index": 0, "text": "ok",
                                                  "finish_reason": "stop"}]})
            return JSONResponse({"id": "r", "object": "response", "status": "completed",
                                 "output": [], "usage": usage})

    def got(self, where: Callable[[dict[str, Any]], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(where(b) for b in self.received):
            assert time.monotonic() < deadline, "the upstream never got the request"
            time.sleep(0.02)


@pytest.fixture
def engine(tmp_path) -> Iterator[tuple[Engine, ServerThread]]:
    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0),
                    registry=CollectorRegistry())
    e = Engine(store)
    with ServerThread(e.app) as up:
        yield e, up
    store.close()


def start(up: ServerThread, tmp_path: Path, tiny_model: Path, **windows: Any) -> ServerThread:
    settings = make_settings(up.url, tmp_path / "memory", tiny_model, windows={
        "store": {"disk_path": str(tmp_path / "kv")}, "settle_s": 0, **windows})
    return ServerThread(create_app(settings)).start()


def history(turns: int, first: str = "Hello there") -> list[dict[str, str]]:
    """A chat whose last message is the client's ``turns``-th."""
    out: list[dict[str, str]] = []
    for i in range(turns):
        out += [{"role": "user", "content": first if i == 0 else f"and then {i}?"},
                {"role": "assistant", "content": "ok"}]
    return out[:-1]


def users(body: dict[str, Any]) -> int:
    return sum(m.get("role") == "user" for m in body.get("messages") or [])


def ask(srv: ServerThread, messages: list[dict], session: str = "s",
        headers: dict[str, str] = ACME) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", timeout=120,
                      headers={**headers, "X-Session-Id": session},
                      json={"model": "tiny", "messages": messages, "max_tokens": 4})


def freeze(srv: ServerThread, name: str, session: str = "s", headers: dict[str, str] = ACME,
           **more: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/windows", timeout=120, headers=headers,
                      json={"name": name, "session": session, **more})


def test_a_freeze_takes_the_turn_that_arrived_last_on_every_salted_route(engine, tmp_path,
                                                                         tiny_model):
    e, up = engine
    srv = start(up, tmp_path, tiny_model, wait_s=30)
    try:
        with ThreadPoolExecutor(1) as pool:
            # turn 5 arrives first and finishes last: turn 6's record stays the latest
            e.hold = lambda body: users(body) == 5
            late = pool.submit(ask, srv, history(5))
            e.got(lambda b: users(b) == 5)
            assert ask(srv, history(6)).status_code == 200
            e.hold = lambda body: False
            assert late.result().status_code == 200
        r = freeze(srv, "latest")
        assert r.status_code == 200, r.text
        assert (r.json()["turn"], r.json()["tokens"]) == (6, 6 * BS + 3)
        assert freeze(srv, "fifth", turn=5).json()["turn"] == 5
        # completions and responses of the session are its next turns, frozen like chat's
        for path, turn in (("completions", 7), ("responses", 8)):
            r = httpx.post(f"{srv.url}/v1/{path}", timeout=60,
                           headers={**ACME, "X-Session-Id": "s"},
                           json={"model": "tiny", "prompt": "x", "input": "x"})
            assert r.status_code == 200, r.text
            sent = e.received[-1]["kv_transfer_params"]["cwm"]
            assert sent["turn"] == turn and sent["at"] > 0
            w = freeze(srv, f"after-{path}")
            assert w.status_code == 200 and w.json()["turn"] == turn, w.text
        # a request of no session names no turn and leaves no record
        httpx.post(f"{srv.url}/v1/completions", headers=ACME, timeout=60,
                   json={"model": "tiny", "prompt": "x"})
        assert e.received[-1]["kv_transfer_params"] == {"cwm": {"record": False}}
    finally:
        srv.stop()


def test_a_turns_prompt_state_is_the_one_its_prompt_was_assembled_with(engine, tmp_path,
                                                                       tiny_model):
    """Two conversations in one session at once: the turn that finishes last keeps its own
    memory block in its conversation record, not the one the other turn pinned meanwhile."""
    e, up = engine
    srv = start(up, tmp_path, tiny_model)
    try:
        runtime(srv).memory.service.add_memory("acme", "The user's dog is called Fido.",
                                               "fact", 0.9)
        first = history(1, "Where does my dog like to walk?")
        second = history(2, "A new conversation about cats")
        with ThreadPoolExecutor(1) as pool:
            e.hold = lambda body: users(body) == 1
            held = pool.submit(ask, srv, first)
            e.got(lambda b: users(b) == 1)
            assert ask(srv, second).status_code == 200
            e.hold = lambda body: False
            assert held.result().status_code == 200
        convs = ConversationRecords(e.store)
        deadline = time.monotonic() + 30
        while (rec := convs.read(salt("acme", "s"), 1)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert rec.prompt["pinned"]["key"].startswith(digest(first[0]) + ":")
    finally:
        srv.stop()


def test_refusals_answer_at_once_and_a_freeze_waits_only_for_a_turn_on_its_way(
        engine, tmp_path, tiny_model):
    e, up = engine
    srv = start(up, tmp_path, tiny_model, wait_s=600)   # any needless wait: the test hangs
    try:
        assert ask(srv, history(1)).status_code == 200
        assert ask(srv, history(2)).status_code == 200
        t0 = time.perf_counter()
        assert httpx.get(f"{srv.url}/v1/windows", headers=ACME).status_code == 200
        baseline = time.perf_counter() - t0
        r = freeze(srv, "gone", turn=9)                     # not kept: refused, no wait
        assert r.status_code == 404 and "kept: 1, 2" in r.json()["error"]["message"], r.text
        t0 = time.perf_counter()
        r = freeze(srv, "nobody", session="never-seen")     # nothing stored: refused at once
        assert r.status_code == 404
        assert time.perf_counter() - t0 < 10 * baseline + 1.0
        # a turn still in flight is worth the wait: the freeze takes it, not the one before
        with ThreadPoolExecutor(2) as pool:
            e.hold = lambda body: users(body) == 3
            turn3 = pool.submit(ask, srv, history(3))
            e.got(lambda b: users(b) == 3)
            frozen = pool.submit(freeze, srv, "third")
            time.sleep(0.3)
            assert not frozen.done()
            e.hold = lambda body: False
            assert turn3.result().status_code == 200
            assert frozen.result().json()["turn"] == 3
        # a turn that left no record (too short to fill a block) holds a freeze only for the
        # moment its record could still take: then the turn before stands
        e.records = lambda body: users(body) != 4
        assert ask(srv, history(4)).status_code == 200
        assert freeze(srv, "fourth").json()["turn"] == 3
    finally:
        e.hold = lambda body: False
        srv.stop()


def test_one_tenant_flooding_slow_freezes_never_holds_up_anothers_window_routes(
        engine, tmp_path, tiny_model):
    e, up = engine
    srv = start(up, tmp_path, tiny_model, wait_s=8, tenant_threads=2)
    release = threading.Event()
    e.hold = lambda body: not release.is_set()
    sessions = [f"busy-{i}" for i in range(8)]
    try:
        with ThreadPoolExecutor(len(sessions) * 2) as pool:
            t0 = time.perf_counter()
            assert httpx.get(f"{srv.url}/v1/windows", headers=BETA).status_code == 200
            alone = time.perf_counter() - t0
            # acme: a turn in flight in each session, and a freeze of each, which waits for it
            chats = [pool.submit(ask, srv, history(1), s) for s in sessions]
            e.got(lambda b: len(e.received) >= len(sessions))
            freezes = [pool.submit(freeze, srv, f"w-{s}", s) for s in sessions]
            time.sleep(0.5)
            t0 = time.perf_counter()
            listed = httpx.get(f"{srv.url}/v1/windows", headers=BETA, timeout=120)
            during = time.perf_counter() - t0
            done = sum(f.done() for f in freezes)
            release.set()
            assert listed.status_code == 200
            assert done == 0, f"beta waited for {done} of acme's freezes ({during:.2f}s, " \
                              f"{alone:.2f}s alone)"
            for f in [*chats, *freezes]:
                assert f.result().status_code == 200
    finally:
        release.set()
        srv.stop()
