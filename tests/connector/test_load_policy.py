"""A block that fails to load is recomputed, never fails its request, under vLLM's default
``kv_load_failure_policy`` too."""

from __future__ import annotations

import logging

import pytest
from vllm.config import KVTransferConfig

from cwm_plugin.connector.connector import recompute_load_failures
from cwm_plugin.errors import ConfigError

pytestmark = pytest.mark.unit


def test_vllms_default_fail_policy_is_set_to_recompute_and_said(caplog):
    ktc = KVTransferConfig(kv_connector="CWMConnector", kv_role="kv_both")
    assert ktc.kv_load_failure_policy == "fail"                  # vLLM's default
    with caplog.at_level(logging.WARNING, logger="cwm_plugin"):
        recompute_load_failures(ktc)
    assert ktc.kv_load_failure_policy == "recompute"
    assert 'set to "recompute"' in caplog.text
    caplog.clear()
    recompute_load_failures(ktc)                                 # already so: nothing said
    assert not caplog.text


def test_a_policy_that_cannot_be_changed_refuses_to_start():
    class Frozen:
        kv_load_failure_policy = "fail"

        def __setattr__(self, name, value):
            raise AttributeError("frozen")

    with pytest.raises(ConfigError, match="kv_load_failure_policy.*recompute"):
        recompute_load_failures(Frozen())
