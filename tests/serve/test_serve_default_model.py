"""`portcullis serve` with no model (issue 31): a real chat model, SmolLM2-135M-Instruct from the
GGUF file `make setup` put in the cache, answers through the gateway and the OpenAI SDK with the
client's default settings — its own chat template, and tool calls through it; and so does the same
model served from a Hugging Face folder."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from portcullis.engine.assets import SMOLLM2, cached
from tests.serve.test_serve import REPO, _free_port, _ready, _wait

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}


def smollm2_folder(weights: Path, out: Path) -> str:
    """SmolLM2 as a Hugging Face folder: the weights transformers wrote from the GGUF file (the
    session's reference), with the tokenizer transformers reads from the same file."""
    from transformers import AutoTokenizer

    for item in weights.iterdir():
        if item.suffix in (".json", ".safetensors") and not item.name.startswith(("tokenizer", "special_tokens")):
            (out / item.name).symlink_to(item)
    path = cached(SMOLLM2)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module", params=["default", "folder"])
def default_serve(request, tmp_path_factory, reference):
    """`portcullis serve` as a user types it (the default model: the GGUF file), and `portcullis
    serve FOLDER` on the same weights converted to a Hugging Face folder."""
    if cached(SMOLLM2) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{SMOLLM2.file} is not in the cache: `make setup` fetches it")
        pytest.skip(f"{SMOLLM2.file} not fetched: run `make setup`")
    home, port = tmp_path_factory.mktemp("default-serve"), _free_port()
    model = [] if request.param == "default" else [
        smollm2_folder(reference(SMOLLM2).folder, tmp_path_factory.mktemp("smollm2")),
        "--served-model-name", "SmolLM2-135M-Instruct"]
    env = {k: v for k, v in os.environ.items() if k != "PORTCULLIS_ENGINE_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "portcullis.cli", "serve", *model, "--port", str(port), "--home", str(home)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    lines, key, deadline = [], None, time.monotonic() + 240
    while key is None:
        assert proc.poll() is None, "serve exited early:\n" + "".join(lines)
        assert time.monotonic() < deadline, "serve did not print a key:\n" + "".join(lines)
        lines.append(proc.stdout.readline())
        if lines[-1].strip().startswith("ptc_"):
            key = lines[-1].strip()
    base = f"http://127.0.0.1:{port}"
    _wait(lambda: _ready(base), 180, "the gateway to be ready")
    yield openai.OpenAI(base_url=base + "/v1", api_key=key), lines
    proc.terminate()
    proc.wait(timeout=60)


def test_serve_with_no_model_answers_with_smollm2(default_serve):
    client, lines = default_serve
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    assert not any("toy" in line for line in lines)  # the demo model's notice is not shown
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"


def test_a_tool_call_through_the_default_model(default_serve):
    client, _ = default_serve
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", tools=[WEATHER], tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )
    (call,) = chat.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    assert chat.choices[0].finish_reason == "tool_calls"
