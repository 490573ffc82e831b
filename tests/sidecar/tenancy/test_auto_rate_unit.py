"""The default request rate is ``auto``: each principal's share of ``rate_limits.server_rate``
(``settings/limits.py``), so a server with many tenants never lets one of them send what the
whole server is sized for; a tenant's own rate, or ``none``, replaces it. Over real HTTP."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from sidecar_helpers import KEYS, make_settings, metric_value

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.settings.limits import RateLimitSettings, share_of
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit


def test_a_share_divides_every_item_and_keeps_at_least_one() -> None:
    assert share_of("200/second;6000/minute", 9) == "22/second;666/minute"
    assert share_of("10/2 hours", 3) == "3/2 hours"
    assert share_of("2/second", 5) == "1/second"
    s = RateLimitSettings()
    assert s.rate_limit == "auto" and s.rate_of(None, 1) == "200/second;6000/minute"
    assert s.rate_of("5/second", 9) == "5/second" and s.rate_of("none", 9) == "none"
    with pytest.raises(ValidationError, match="server_rate is a rate"):
        RateLimitSettings(server_rate="auto")
    with pytest.raises(ValidationError, match="is not like"):
        RateLimitSettings(token_quota="auto")


def test_each_tenant_gets_its_share_of_the_server_rate_by_default(tmp_path: Path) -> None:
    """Three tenants share 6 requests a second: the third request of one tenant within a second
    is refused, while another tenant's are answered; a tenant with its own rate keeps it."""
    with ServerThread(FakeUpstream(model="tiny").app) as up:
        settings = make_settings(up.url, tmp_path / "memory", "tiktoken:cl100k_base",
                                 routing={"health": {"interval_s": 0}},
                                 rate_limits={"server_rate": "6/minute",
                                              "refusal_delay_s": 0})
        settings.tenants[2].rate_limit = "none"  # gamma: its own
        with ServerThread(create_app(settings)) as srv:
            def get(tenant: str) -> int:
                return httpx.get(f"{srv.url}/v1/memory/facts", timeout=30, headers={
                    "Authorization": f"Bearer {KEYS[tenant]}"}).status_code
            assert [get("beta") for _ in range(3)] == [200, 200, 429]
            assert get("acme") == 200  # its second: the metrics below
            assert all(get("gamma") == 200 for _ in range(5))
            assert metric_value(srv, "cwm_sidecar_rate_limited_total", tenant="beta",
                                limit="requests") == 1
