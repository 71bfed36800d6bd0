"""The OpenAI Node SDK (a chat and a streamed chat) where Node is present. The package is installed
once from the npm registry into pytest's cache; without node, npm or the registry the test is
skipped, saying which."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from .conftest import MODEL

NODE_OPENAI = "openai@6.49.0"  # the version issue 30 was reported with
SCRIPT = """
const OpenAI = require("openai");
const client = new OpenAI({baseURL: process.env.BASE_URL, apiKey: process.env.API_KEY});
(async () => {
  const body = {model: process.env.MODEL, max_tokens: 16, messages: [{role: "user", content: "Say hello."}],
                guided_regex: "Hello there\\\\."};
  const chat = await client.chat.completions.create(body);
  let streamed = "";
  for await (const chunk of await client.chat.completions.create({...body, stream: true}))
    streamed += chunk.choices[0]?.delta?.content ?? "";
  console.log(JSON.stringify({text: chat.choices[0].message.content, usage: chat.usage, streamed}));
})().catch((e) => { console.error(e); process.exit(1); });
"""


@pytest.fixture(scope="module")
def node_openai(request):
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("Node SDK check skipped: node or npm is not on PATH")
    # Kept between runs (pytest's cache when it is on, else the temp dir): one install per machine.
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("node-openai") if cache is not None else Path(tempfile.gettempdir()) / "portcullis-node-openai"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "node_modules" / "openai" / "package.json").is_file():
        try:
            run = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(folder), NODE_OPENAI],
                                 capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            pytest.skip(f"Node SDK check skipped: `npm install {NODE_OPENAI}` took over 120 s (no registry?)")
        if run.returncode != 0:
            pytest.skip(f"Node SDK check skipped: `npm install {NODE_OPENAI}` failed: {run.stderr.strip()[-300:]}")
    return folder


def test_node_sdk_chat_and_streamed_chat(node_openai, served):
    env = {"BASE_URL": served["base"] + "/v1", "API_KEY": served["key"], "MODEL": MODEL, "PATH": os.environ.get("PATH", "")}
    run = subprocess.run(["node", "-e", SCRIPT], cwd=node_openai, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["text"] == out["streamed"] == "Hello there."
    assert out["usage"]["completion_tokens"] >= 3 and out["usage"]["prompt_tokens"] > 5

