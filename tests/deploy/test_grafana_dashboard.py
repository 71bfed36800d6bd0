"""deploy/grafana/portcullis-dashboard.json: valid for Grafana's importer (a datasource variable,
unique panel ids, every panel with a query), and every series it queries is one the gateway or
the engine exports, so a renamed metric fails here instead of leaving a panel empty."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "portcullis-dashboard.json"
SOURCES = [ROOT / "portcullis" / "gateway" / "metrics.py", ROOT / "portcullis" / "engine" / "server" / "metrics.py"]
SERIES = re.compile(r"\b(portcullis_gateway_[a-z_]+|vllm:[a-z_]+)")
SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def _exported() -> set[str]:
    text = "\n".join(path.read_text() for path in SOURCES)
    return set(re.findall(r'"(portcullis_gateway_[a-z_]+|vllm:[a-z_]+)"', text))


def _base(series: str) -> str:
    for suffix in SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def test_the_dashboard_loads_and_every_panel_queries_something():
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"] and board["templating"]["list"][0]["type"] == "datasource"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert all(target["expr"].count("(") == target["expr"].count(")") for target in panel["targets"])


def test_every_series_queried_is_exported():
    board = json.loads(DASHBOARD.read_text())
    exported = _exported()
    queried = {SERIES.findall(t["expr"])[i] for p in board["panels"] for t in p["targets"]
               for i in range(len(SERIES.findall(t["expr"])))}
    assert queried and {_base(s) for s in queried} <= exported, sorted({_base(s) for s in queried} - exported)
    # The families the alerts in deploy/README.md rely on are on the board too.
    for family in ("vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc", "portcullis_gateway_requests"):
        assert family in {_base(s) for s in queried}
