"""`priority` over the API: accepted by an engine started with --scheduling-policy priority,
a 400 naming the field on an FCFS engine (as vLLM)."""
from __future__ import annotations

from tests.support.openai_errors import assert_error

BODY = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3, "priority": 4}


def test_priority_is_accepted_only_under_the_priority_policy(server_factory):
    ranked = server_factory(engine=dict(scheduling_policy="priority"))
    with ranked.http() as http:
        r = http.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    plain = server_factory()
    with plain.http() as http:
        assert_error(http.post("/v1/completions", json=BODY), 400, param="priority", says=("--scheduling-policy",))
        assert http.post("/v1/completions", json={**BODY, "priority": 0}).status_code == 200
