"""`portcullis audit usage` on an audit log the gateway really wrote: requests and tokens per
tenant, principal and model over a period, as a table and as JSON, for chargeback."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from portcullis.cli import main
from portcullis.gateway.audit.review import period_range, usage

BODY = {"model": "demo", "prompt": "hi there", "max_tokens": 12}


async def _traffic(gw) -> dict[tuple[str, str, str], dict[str, int]]:
    """Send a mix of requests; return what each (tenant, principal, model) was told it used."""
    told: dict[tuple[str, str, str], dict[str, int]] = {}
    sends = [("alice", "demo"), ("alice2", "demo"), ("alice", "other"), ("bob", "demo"), ("carol", "other"),
             ("bob", "other")]  # bob may use demo only: the last is refused
    who = {"alice": "alice", "alice2": "alice", "bob": "bob", "carol": "carol"}
    tenant = {"alice": "acme", "bob": "acme", "carol": "globex"}
    async with gw.client() as client:
        for key, model in sends:
            response, _ = await gw.call(client, "POST", "/v1/completions", json={**BODY, "model": model},
                                        headers=gw.auth(key))
            row = told.setdefault((tenant[who[key]], who[key], model),
                                  {"requests": 0, "denied": 0, "prompt_tokens": 0, "completion_tokens": 0})
            if response.status_code == 200:
                row["requests"] += 1
                usage = response.json()["usage"]
                row["prompt_tokens"] += usage["prompt_tokens"]
                row["completion_tokens"] += usage["completion_tokens"]
            else:
                row["denied"] += 1
    return told


async def test_usage_sums_what_clients_were_told_per_tenant_principal_and_model(gw, capsys):
    told = await _traffic(gw)
    assert main(["audit", "--file", str(gw.audit_path), "usage", "--period", "day", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["by"] == ["tenant", "principal", "model"]
    got = {(r["tenant"], r["principal"], r["model"]): r for r in report["rows"]}
    assert set(got) == set(told)
    for key, expected in told.items():
        row = got[key]
        assert {name: row[name] for name in expected} == expected, key
        assert row["total_tokens"] == row["prompt_tokens"] + row["completion_tokens"] and row["failed"] == 0
    assert got[("acme", "bob", "other")]["denied"] == 1 and got[("acme", "bob", "other")]["total_tokens"] == 0
    assert got[("acme", "alice", "demo")]["requests"] == 2  # two keys of one principal

    assert main(["audit", "--file", str(gw.audit_path), "usage", "--by", "tenant", "--json"]) == 0
    tenants = {r["tenant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    acme = [v for k, v in told.items() if k[0] == "acme"]
    assert tenants["acme"]["completion_tokens"] == sum(v["completion_tokens"] for v in acme)
    assert tenants["acme"]["requests"] == 4 and tenants["globex"]["requests"] == 1


async def test_usage_table_and_ranges(gw, capsys):
    await _traffic(gw)
    assert main(["audit", "--file", str(gw.audit_path), "usage", "--tenant", "globex"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("usage from the start of the log until now")
    assert out[1].split() == ["tenant", "principal", "model", "requests", "denied", "failed", "prompt_tokens",
                              "completion_tokens", "total_tokens", "estimated_tokens"]
    assert out[2].split()[:4] == ["globex", "carol", "other", "1"] and len(out) == 3
    assert main(["audit", "--file", str(gw.audit_path), "usage", "--period", "2020-01"]) == 0
    assert "usage from 2020-01-01T00:00:00+00:00 until 2020-02-01T00:00:00+00:00\nno matching records" in (
        capsys.readouterr().out)
    assert main(["audit", "--file", str(gw.audit_path), "usage", "--since", "1h", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rows"]) == 5
    assert main(["audit", "--file", str(gw.audit_path), "usage", "--period", "week"]) == 2
    assert "is not a period: give day, month" in capsys.readouterr().err
    assert main(["audit", "--file", str(gw.audit_path), "usage", "--period", "day", "--since", "1h"]) == 2
    assert main(["audit", "--file", str(gw.audit_path), "usage", "--by", "team"]) == 2


def test_periods_are_utc_calendar_days_and_months():
    now = datetime(2026, 12, 31, 23, 30, tzinfo=timezone.utc)
    assert period_range("day", now) == (datetime(2026, 12, 31, tzinfo=timezone.utc),
                                        datetime(2027, 1, 1, tzinfo=timezone.utc))
    assert period_range("month", now) == (datetime(2026, 12, 1, tzinfo=timezone.utc),
                                          datetime(2027, 1, 1, tzinfo=timezone.utc))
    assert period_range("2027-02", now)[1] == datetime(2027, 3, 1, tzinfo=timezone.utc)
    assert period_range("2028-02-29", now)[1] == datetime(2028, 3, 1, tzinfo=timezone.utc)


def test_the_gateways_estimates_stay_out_of_the_engine_reported_tokens():
    """A line whose tokens the gateway estimated (the engine reported none) is billed apart."""
    line = {"tenant": "acme", "principal": "alice", "model": "demo", "decision": "allowed"}
    rows = usage(iter([{**line, "prompt_tokens": 5, "completion_tokens": 7},
                       {**line, "decision": "failed", "prompt_tokens": 5, "completion_tokens": 64,
                        "tokens_estimated": True}]))
    assert rows == [{"tenant": "acme", "principal": "alice", "model": "demo", "requests": 2, "denied": 0,
                     "failed": 1, "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                     "estimated_tokens": 69}]
