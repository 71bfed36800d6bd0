"""The application's lifespan (start-up objects leave the cyclic collector while serving), and
the settings that start it: unsafe client-connection limits are refused."""

from __future__ import annotations

import gc

import pytest
import yaml

from portcullis.cli import main
from portcullis.gateway.settings import GatewaySettings
from portcullis.protocol.channel import ENGINE_TOKEN_ENV as TOKEN_ENV

from .conftest import ENGINE_TOKEN, base_policy


def test_startup_objects_are_frozen_while_serving_and_handed_back_after(gateways):
    running = gateways.start()
    # Frozen, a full collection no longer walks them: no 15-35 ms stall mid-request.
    assert gc.get_freeze_count() > 10_000
    running.server.stop()
    assert gc.get_freeze_count() == 0


# ---- client connection limits (gateway/connection.py, exercised in tests/reliability) ----

UNSAFE = [("--timeout-header", "0"), ("--timeout-header", "3600"), ("--timeout-body", "0"),
          ("--timeout-send", "-1"), ("--timeout-keep-alive", "0"), ("--limit-concurrency", "0"),
          ("--h11-max-incomplete-event-size", str(100 * 2**20))]


@pytest.mark.parametrize(("flag", "value"), UNSAFE)
def test_gateway_refuses_unsafe_connection_limits(flag, value, tmp_path, monkeypatch, capsys):
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(base_policy()))
    monkeypatch.setenv(TOKEN_ENV, ENGINE_TOKEN)
    assert main(["gateway", "--policy", str(policy), flag, value]) == 2
    message = capsys.readouterr().err
    assert message.startswith(f"portcullis: refusing to start: {flag}: "), message


def test_connection_limits_are_on_by_default(tmp_path):
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(base_policy()))
    settings = GatewaySettings(policy=tmp_path / "policy.yaml", engine_token=ENGINE_TOKEN)
    assert settings.timeout_header_s <= 60 and settings.timeout_body_s <= 600 and settings.timeout_send_s <= 600
    assert settings.limit_concurrency <= 100_000 and settings.h11_max_incomplete_event_size <= 2**20


@pytest.mark.parametrize("proxies", ["10.0.0.300", "10.0.0.0/33", "proxy.internal", "127.0.0.1,", ""])
def test_a_trusted_proxy_that_is_not_an_address_is_refused(proxies, tmp_path):
    # uvicorn would keep it as a string no peer matches: the proxy's X-Forwarded-For ignored, and
    # every client behind it sharing one address (and one failed-authentication budget).
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(base_policy()))
    with pytest.raises(ValueError, match="not an IP address or a network"):
        GatewaySettings(policy=tmp_path / "policy.yaml", engine_token=ENGINE_TOKEN, forwarded_allow_ips=proxies)
    GatewaySettings(policy=tmp_path / "policy.yaml", engine_token=ENGINE_TOKEN,
                    forwarded_allow_ips="127.0.0.1, 10.0.0.0/8,fd00::/8")
