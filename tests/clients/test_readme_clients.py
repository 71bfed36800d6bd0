"""docs/clients.md (the README's "Clients" section until issue 33) as a user pastes it: each Python
snippet runs against `portcullis serve`; the Claude Code environment drives the Anthropic SDK (which
reads the same variables), and Codex's and Continue's configuration files point an SDK at routes
that answer."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import tomllib
import yaml

from .conftest import MODEL

SECTION = (Path(__file__).resolve().parents[2] / "docs" / "clients.md").read_text()
DEFAULT_BASE = "http://127.0.0.1:8000"


def _blocks(lang: str, served) -> list[str]:
    return [b.replace(DEFAULT_BASE, served["base"]) for b in re.findall(rf"```{lang}\n(.*?)```", SECTION, re.DOTALL)]


def test_each_python_snippet_runs(served, tmp_path):
    snippets = _blocks("python", served)
    assert len(snippets) == 3, "docs/clients.md's snippets changed: update this test"
    env = {**os.environ, "PORTCULLIS_API_KEY": served["key"]}
    for snippet in snippets:
        run = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0 and run.stdout.strip(), run.stderr[-2000:]


def test_claude_code_environment_drives_the_anthropic_sdk(served, monkeypatch):
    [block] = _blocks("bash", served)
    monkeypatch.setenv("PORTCULLIS_API_KEY", served["key"])
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    for name, value in re.findall(r"(\w+)=(\S+)", block):
        monkeypatch.setenv(name, os.path.expandvars(value))
    message = anthropic.Anthropic().messages.create(model=os.environ["ANTHROPIC_MODEL"], max_tokens=4,
                                                    messages=[{"role": "user", "content": "hi"}])
    assert message.usage.output_tokens >= 1


def test_codex_configuration_reaches_the_responses_api(served, monkeypatch):
    [block] = _blocks("toml", served)
    config = tomllib.loads(block)
    provider = config["model_providers"][config["model_provider"]]
    assert provider["wire_api"] == "responses"
    monkeypatch.setenv(provider["env_key"], served["key"])
    client = openai.OpenAI(base_url=provider["base_url"], api_key=os.environ[provider["env_key"]])
    response = client.responses.create(model=config["model"], input="hi", max_output_tokens=4)
    assert response.usage.output_tokens >= 1


def test_continue_configuration_chat_and_autocomplete(served):
    [block] = _blocks("yaml", served)
    models = yaml.safe_load(block)["models"]
    by_role = {role: m for m in models for role in m["roles"]}
    assert {"chat", "autocomplete", "embed"} <= set(by_role)
    chat = by_role["chat"]
    assert chat["provider"] == "openai" and chat["model"] == MODEL
    client = openai.OpenAI(base_url=chat["apiBase"], api_key=served["key"])
    reply = client.chat.completions.create(model=chat["model"], max_tokens=4, stream=True,
                                           messages=[{"role": "user", "content": "hi"}])
    assert any(c.choices and c.choices[0].finish_reason for c in reply)
    completion = client.completions.create(model=by_role["autocomplete"]["model"], prompt="def f(", max_tokens=4)
    assert completion.usage.completion_tokens >= 1
    # The embed role names a second, embedding model that this suite does not serve.
    assert by_role["embed"]["apiBase"] == chat["apiBase"]
