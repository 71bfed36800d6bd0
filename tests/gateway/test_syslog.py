"""`--audit-syslog`: every audit line also goes to a syslog server as an RFC 5424 message
(facility log audit, the line's JSON as the message), over UDP or a Unix datagram socket."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from portcullis import cli

from .conftest import ENGINE_TOKEN, base_policy, write_policy_file

# <PRI>VERSION TIMESTAMP HOSTNAME APP-NAME PROCID MSGID STRUCTURED-DATA BOM MSG
RFC5424 = re.compile(rb"^<110>1 (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z) (\S+) portcullis (\d+) audit - "
                     rb"\xef\xbb\xbf(\{.*\})$", re.S)


def _messages(sock: socket.socket, wanted: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    sock.settimeout(0.2)
    deadline = time.monotonic() + timeout
    while len(found) < wanted and time.monotonic() < deadline:
        try:
            datagram = sock.recv(65536)
        except TimeoutError:
            continue
        match = RFC5424.match(datagram)
        assert match, datagram[:200]
        found.append(json.loads(match.group(4)))
    return found


def test_audit_lines_reach_a_udp_syslog_server(gateways):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        gw = gateways.start(audit_syslog=f"udp://127.0.0.1:{server.getsockname()[1]}")
        allowed = httpx.get(gw.url + "/v1/models", headers=gw.auth())
        refused = httpx.get(gw.url + "/v1/models", headers={"authorization": "Bearer nope-" + "x" * 20})
        messages = _messages(server, 3)
    assert [m.get("event") for m in messages[:1]] == ["gateway_start"]
    by_id = {m.get("request_id"): m for m in messages}
    assert by_id[allowed.headers["x-request-id"]]["status"] == 200
    assert by_id[refused.headers["x-request-id"]]["reason"] == "invalid_key"
    in_file = asyncio.run(gw.wait_audit(2))
    assert [r["request_id"] for r in in_file] == [allowed.headers["x-request-id"], refused.headers["x-request-id"]]
    for record in in_file:  # the very lines of the file: chained and MACed, so a copy can be checked
        assert by_id[record["request_id"]] == record and "mac" in record


def test_audit_lines_reach_a_unix_datagram_socket(gateways, tmp_path):
    path = tmp_path / "log.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        gw = gateways.start(audit_syslog=f"unix://{path}")
        response = httpx.get(gw.url + "/v1/models", headers=gw.auth())
        messages = _messages(server, 2)
    assert messages[-1]["request_id"] == response.headers["x-request-id"]


def test_a_syslog_server_that_is_gone_costs_no_request(gateways, tmp_path):
    gw = gateways.start(audit_syslog=f"unix://{tmp_path / 'nobody-listens.sock'}")
    response = httpx.get(gw.url + "/v1/models", headers=gw.auth())
    assert response.status_code == 200
    assert asyncio.run(gw.wait_audit(1))[-1]["request_id"] == response.headers["x-request-id"]
    assert gw.gateway.audit_syslog.dropped >= 2  # the start line and this one, counted


@pytest.mark.parametrize("url", ["udp://logs:514/x", "tcp://logs:514", "udp://logs", "unix:relative.sock", "logs:514"])
def test_a_syslog_address_that_cannot_work_refuses_to_start(url, tmp_path, monkeypatch, capsys):
    write_policy_file(tmp_path / "policy.yaml", base_policy())
    monkeypatch.setenv("PORTCULLIS_ENGINE_TOKEN", ENGINE_TOKEN)
    assert cli.main(["gateway", "--policy", str(tmp_path / "policy.yaml"), "--audit-syslog", url]) == 2
    assert "--audit-syslog: " in capsys.readouterr().err
    with pytest.raises(ValidationError, match="is not a syslog address"):
        from portcullis.gateway.settings import GatewaySettings

        GatewaySettings(policy=tmp_path / "policy.yaml", engine_token=ENGINE_TOKEN, audit_syslog=url)


def test_a_syslog_host_that_does_not_resolve_yet_starts_and_counts_its_drops(gateways):
    gw = gateways.start(audit_syslog="udp://syslog.portcullis.invalid:514")  # resolved lazily, not at start
    response = httpx.get(gw.url + "/v1/models", headers=gw.auth())
    assert response.status_code == 200
    assert asyncio.run(gw.wait_audit(1))[-1]["request_id"] == response.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while gw.gateway.audit_syslog.dropped < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # the writer thread sends after the line reached the file
    scrape = httpx.get(gw.url + "/gateway/metrics", headers=gw.auth("root")).text
    dropped = re.search(r"^portcullis_gateway_audit_syslog_dropped_total ([0-9.]+)$", scrape, re.M)
    assert dropped and float(dropped.group(1)) >= 2  # the start line and this request's


@pytest.mark.parametrize(("url", "warned"), [("udp://192.0.2.10:514", True), ("udp://127.0.0.1:514", False),
                                             ("udp://localhost:514", False)])
def test_prompts_logged_to_an_off_host_udp_syslog_are_warned_of(gateways, url, warned):
    from structlog.testing import capture_logs

    policy = base_policy()
    policy.setdefault("audit", {})["log_prompts"] = True
    with capture_logs() as logs:
        gateways.start(policy, audit_syslog=url)
    events = [entry for entry in logs if entry["event"] == "audit_prompts_leave_host_in_cleartext"]
    assert bool(events) is warned
    assert all("log_prompts" in entry["hint"] for entry in events)
