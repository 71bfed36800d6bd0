"""The console in a real headless Chromium: an admin logs in with a key at the browser's
prompt, finds a refused request by tenant and reason, sees the chain verified and then
tampered once a line is edited, sees the usage chart drawn with the audit's totals; a plain
key gets nothing, and a page on another site cannot read the console with the admin's login."""
from __future__ import annotations

import http.server
import os
import threading
from datetime import datetime, timezone

import httpx
import pytest

from tests.support.chromium import Browser, needs_chromium

CONSOLE = "/gateway/console"
SHOTS = os.environ.get("PORTCULLIS_CONSOLE_SCREENSHOTS")  # a folder: each page's screenshot goes there


def _shoot(browser: Browser, page: str) -> None:
    if SHOTS:
        from pathlib import Path

        browser.screenshot(Path(SHOTS) / f"console-{page}.png")


@pytest.fixture
def browser():
    opened = Browser(needs_chromium())
    yield opened
    opened.close()


def _traffic(gw) -> None:
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        for _ in range(2):
            assert client.post("/v1/completions", json={"model": "demo", "prompt": "hi"},
                               headers=gw.auth("alice")).status_code == 200
        assert client.post("/v1/completions", json={"model": "other", "prompt": "x"},
                           headers=gw.auth("bob")).status_code == 403  # bob may use demo only
        assert client.post("/v1/completions", json={"model": "demo", "prompt": "hey"},
                           headers=gw.auth("carol")).status_code == 200
    gw.gateway.audit.flush()


def _login(browser: Browser, gw, name: str, page: str = "audit") -> None:
    browser.credentials = ("admin", gw.keys[name])
    browser.open(f"{gw.url}{CONSOLE}#{page}")


def test_an_admin_finds_a_refusal_and_sees_the_chain_and_usage(gw, browser):
    _traffic(gw)
    _login(browser, gw, "root")
    browser.wait_for("document.body && document.body.dataset.loaded === 'audit'")
    assert browser.wait_for("document.getElementById('chain-status').dataset.status") == "verified"

    browser.evaluate("""(() => { const f = document.getElementById('audit-filter');
        f.tenant.value = 'acme'; f.reason.value = 'model_not_allowed';
        document.body.dataset.loaded = ''; f.requestSubmit(); })()""")
    browser.wait_for("document.body.dataset.loaded === 'audit'")
    rows = browser.evaluate("[...document.querySelectorAll('#audit-table tbody tr')].map(r => r.innerText)")
    assert len(rows) == 1 and "bob" in rows[0] and "403" in rows[0] and "model_not_allowed" in rows[0]
    browser.evaluate("document.querySelector('#audit-table tbody tr').click()")
    detail = browser.wait_for("document.getElementById('audit-detail').textContent")
    assert '"model": "other"' in detail and '"decision": "denied"' in detail
    _shoot(browser, "audit")

    browser.evaluate("location.hash = 'usage'")
    browser.wait_for("document.body.dataset.loaded === 'usage'")
    bars = browser.evaluate("[...document.querySelectorAll('#usage-chart rect')]"
                            ".map(b => [b.dataset.label, Number(b.dataset.total), b.getBBox().width])")
    today = datetime.now(timezone.utc).date().isoformat()
    served = [r for r in gw.audit_records() if r.get("route") == "/v1/completions" and r["time"].startswith(today)]
    want = {}
    for r in served:
        want[r["tenant"]] = want.get(r["tenant"], 0) + (r.get("prompt_tokens") or 0) + (r.get("completion_tokens") or 0)
    drawn = {label: total for label, total, _ in bars}
    assert drawn["acme"] == want["acme"] > 0 and drawn["globex"] == want["globex"] > 0
    assert all(width > 0 for _, total, width in bars if total)
    refusals = browser.evaluate("[...document.querySelectorAll('#refusals-table tbody tr')].map(r => r.innerText)")
    assert "model_not_allowed\t1" in refusals  # (beside the browser's own favicon request: route_not_allowed)
    hours = browser.evaluate("[...document.querySelectorAll('#usage-series rect')].map(b => Number(b.dataset.tokens))")
    assert len(hours) == 24 and sum(hours) == sum(want.values()) and max(hours) > 0
    _shoot(browser, "usage")
    for page in ("keys", "policy", "fleet"):
        browser.evaluate(f"location.hash = '{page}'")
        browser.wait_for(f"document.body.dataset.loaded === '{page}'")
        _shoot(browser, page)
    assert browser.evaluate("document.querySelector('#fleet-table tbody td span').title").startswith("unix:")
    assert browser.evaluate("document.querySelectorAll('#keys-table tbody tr').length") == len(gw.gateway.store.current.keys)

    browser.evaluate("location.hash = 'audit'")
    browser.wait_for("document.body.dataset.loaded === 'audit'")
    gw.gateway.audit.flush()
    lines = gw.audit_path.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if '"other"' in line)
    lines[at] = lines[at].replace('"other"', '"demo"')
    gw.audit_path.write_text("".join(lines))
    browser.send("Page.reload")
    assert browser.wait_for("document.body && document.getElementById('chain-status')"
                            " && document.getElementById('chain-status').dataset.status") == "tampered"
    browser.wait_for("document.body.dataset.loaded === 'audit'")
    _shoot(browser, "tampered")


def test_a_plain_key_gets_nothing_of_the_console(gw, browser):
    _login(browser, gw, "alice")
    text = browser.wait_for("document.readyState === 'complete' && document.body && document.body.innerText")
    assert "Not found" in text and "console" not in text.lower()
    assert not browser.evaluate("!!document.getElementById('chain-status')")


class _Elsewhere(http.server.BaseHTTPRequestHandler):
    """Another site: a page that tries to read the console with the visitor's credentials."""

    target = ""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = ('<html><body><p id="out">waiting</p><script src="/steal.js"></script></body></html>'
                if self.path == "/" else
                f"fetch('{self.target}', {{credentials: 'include'}}).then(r => r.text())"
                f".then(t => document.getElementById('out').textContent = 'read: ' + t)"
                f".catch(e => document.getElementById('out').textContent = 'blocked');")
        self.send_response(200)
        self.send_header("content-type", "text/html" if self.path == "/" else "text/javascript")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args) -> None:
        pass


def test_another_site_cannot_read_the_console_with_the_admins_login(gw, browser):
    _traffic(gw)
    _login(browser, gw, "root")  # the admin is logged in: the browser holds the credentials
    browser.wait_for("document.body && document.body.dataset.loaded === 'audit'")
    _Elsewhere.target = f"{gw.url}{CONSOLE}/api/audit"  # the same host on another port: same-site, not same-origin
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Elsewhere)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        browser.open(f"http://127.0.0.1:{site.server_address[1]}/")
        assert browser.wait_for("document.getElementById('out') && document.getElementById('out').textContent"
                                " !== 'waiting' && document.getElementById('out').textContent") == "blocked"
    finally:
        site.shutdown()
    lines = [r for r in gw.audit_records() if r.get("route") == f"{CONSOLE}/*"]
    assert lines and lines[-1]["decision"] == "denied" and lines[-1]["status"] == 404
    assert lines[-1]["principal"] is None  # refused before its credentials were even read


def test_with_writes_enabled_an_admin_revokes_a_key_and_its_next_request_is_refused(gateways, browser):
    from .conftest import base_policy

    gw = gateways.start({**base_policy(), "console": {"write_scope": "admin"}})
    bob = gw.keys["bob"].split(".")[0].removeprefix("ptc_")
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        assert client.post("/v1/completions", json={"model": "demo", "prompt": "hi"},
                           headers=gw.auth("bob")).status_code == 200
    _login(browser, gw, "root", "keys")
    browser.wait_for("document.body && document.body.dataset.loaded === 'keys'")
    button = f"document.querySelector('button.revoke[data-key=\"{bob}\"]')"
    browser.wait_for(f"!!{button}")
    browser.evaluate(f"{button}.click()")  # arms it
    assert browser.evaluate(f"{button}.textContent") == "Confirm revoke"
    browser.evaluate(f"document.body.dataset.loaded = ''; {button}.click()")
    browser.wait_for("document.body.dataset.loaded === 'keys'")
    states = browser.evaluate("Object.fromEntries([...document.querySelectorAll('#keys-table tbody tr')]"
                              ".map(r => [r.cells[0].innerText, r.cells[6].innerText]))")
    assert states[bob] == "revoked" and not browser.evaluate(f"!!{button}")
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        refused = client.post("/v1/completions", json={"model": "demo", "prompt": "hi"}, headers=gw.auth("bob"))
    assert refused.status_code == 401
    actions = [e for e in gw.gateway_events() if e.get("event") == "admin_action"]
    assert [(a["action"], a["actor"], a["key_id"]) for a in actions] == [("key_revoked", "root", bob)]


def test_with_writes_enabled_an_admin_creates_a_key_and_edits_the_policy(gateways, browser):
    from .conftest import base_policy

    gw = gateways.start({**base_policy(), "console": {"write_scope": "admin"}})
    _login(browser, gw, "root", "keys")
    browser.wait_for("document.body && document.body.dataset.loaded === 'keys'")
    browser.evaluate("""(() => { const f = document.getElementById('key-create');
        f.principal.value = 'erin'; f.tenant.value = 'globex'; f.note.value = 'from the console';
        f.requestSubmit(); })()""")
    token = browser.wait_for("document.getElementById('key-token').dataset.token")
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        assert client.post("/v1/completions", json={"model": "demo", "prompt": "hi"},
                           headers={"authorization": f"Bearer {token}"}).status_code == 200

    browser.evaluate("location.hash = 'policy'")
    browser.wait_for("document.body.dataset.loaded === 'policy' && document.querySelector('#policy-edit textarea').value")
    browser.evaluate("""(() => { const t = document.querySelector('#policy-edit textarea');
        t.value = t.value.replace('tenants:', 'tenants:\\n  bad: {modles: [x]}'); })()""")
    browser.evaluate("document.getElementById('policy-check').click()")
    assert browser.wait_for("document.getElementById('policy-result').dataset.state") == "invalid"
    assert "modles" in browser.evaluate("document.getElementById('policy-result').textContent")
    browser.evaluate("""(() => { const t = document.querySelector('#policy-edit textarea');
        t.value = t.value.replace('\\n  bad: {modles: [x]}', '').replace('max_tokens: 256', 'max_tokens: 32');
        document.getElementById('policy-result').dataset.state = '';
        document.getElementById('policy-edit').requestSubmit(); })()""")
    assert browser.wait_for("document.getElementById('policy-result').dataset.state") == "saved"
    _shoot(browser, "policy-edit")
    assert "max_tokens: 32" in gw.policy_path.read_text()
    assert gw.gateway.store.generation == 2  # the new key, then the edit
    actions = [e["action"] for e in gw.gateway_events() if e.get("event") == "admin_action"]
    assert actions == ["key_created", "policy_edited"]
