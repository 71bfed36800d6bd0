"""The bundled demo model behind the server: what `portcullis serve` with no model shows a new
user. Skipped until the demo weights are committed."""
from __future__ import annotations

import pytest

from portcullis.engine import LLM, SamplingParams
from portcullis.engine.assets import DEMO_MODEL_DIR

pytestmark = pytest.mark.skipif(not (DEMO_MODEL_DIR / "model.safetensors").is_file(),
                                reason="the demo model's weights are not committed yet")

PROMPT = "def fibonacci(n):"


def test_demo_model_writes_python_and_matches_offline(demo_server):
    client = demo_server.client()
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=48, temperature=0)
    offline = LLM(str(DEMO_MODEL_DIR), max_model_len=512, kv_cache_memory=64 << 20)
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    assert out.choices[0].text == want.text
    assert "\n" in out.choices[0].text
    stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=48, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want.text


def test_demo_model_chat_stops_on_its_own(demo_server):
    out = demo_server.client().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Write a function that adds two numbers."}],
        max_tokens=200, temperature=0,
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 200
