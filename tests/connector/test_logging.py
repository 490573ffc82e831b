"""The connector's log lines reach vLLM's log (vLLM configures only its own ``vllm`` logger)."""

from __future__ import annotations

import io
import logging

import pytest

from cwm_plugin.connector.connector import use_vllm_log_handlers

pytestmark = pytest.mark.unit


@pytest.fixture
def loggers(monkeypatch):
    ours, theirs = logging.getLogger("cwm_plugin"), logging.getLogger("vllm")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    monkeypatch.setattr(theirs, "handlers", [handler])
    monkeypatch.setattr(theirs, "level", logging.INFO)
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    return ours, stream


def bare_root(monkeypatch) -> None:
    """No handler on the root logger, as in vLLM's processes (pytest adds its own during a
    test's call, so this runs in the test body, not in a fixture)."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def test_info_lines_of_the_connector_go_through_vllms_handlers(loggers, monkeypatch):
    ours, stream = loggers
    bare_root(monkeypatch)
    logging.getLogger("cwm_plugin.connector.worker.side").info("lost without the handlers")
    assert stream.getvalue() == ""  # before: dropped (root shows warnings only)
    use_vllm_log_handlers()
    use_vllm_log_handlers()  # idempotent: one line a record, not two
    logging.getLogger("cwm_plugin.connector.worker.side").info("store flushed")
    assert stream.getvalue() == "INFO cwm_plugin.connector.worker.side store flushed\n"


@pytest.mark.parametrize("where", ["cwm_plugin", ""])
def test_logging_the_application_set_up_is_left_alone(loggers, monkeypatch, where):
    ours, stream = loggers
    bare_root(monkeypatch)
    own = logging.StreamHandler(io.StringIO())
    logging.getLogger(where or None).handlers = [own]
    use_vllm_log_handlers()
    assert ours.handlers == ([own] if where else [])
    logging.getLogger("cwm_plugin.connector").warning("x")
    assert stream.getvalue() == ""                        # never twice, never vLLM's stream
