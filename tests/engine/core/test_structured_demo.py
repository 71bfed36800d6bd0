"""Guaranteed structure on a real model: 200 sampled generations (temperature 1.0) from the demo
model against a nested JSON Schema all parse and validate."""
from __future__ import annotations

import json

import jsonschema
import pytest

from portcullis.engine import LLM, SamplingParams
from portcullis.engine.assets import DEMO_MODEL_DIR
from portcullis.engine.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "version": {"type": "integer", "minimum": 0, "maximum": 99},
        "stable": {"type": "boolean"},
        "owner": {
            "type": "object",
            "properties": {"team": {"enum": ["core", "infra", "ml"]}, "size": {"type": "integer", "minimum": 1, "maximum": 50}},
            "required": ["team", "size"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "version", "stable", "owner", "tags"],
    "additionalProperties": False,
}


@pytest.mark.skipif(not (DEMO_MODEL_DIR / "model.safetensors").is_file(), reason="demo weights not present")
def test_two_hundred_sampled_generations_follow_a_nested_schema():
    llm = LLM(str(DEMO_MODEL_DIR), max_model_len=512, kv_cache_memory=256 << 20)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)) for i in range(200)]
    outs = llm.generate([f"# project {i}\nconfig = " for i in range(200)], params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert len({o.outputs[0].text for o in outs}) > 100  # sampled, not one answer repeated


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 16}, {"type": "string", "minLength": 1}, {"type": "string"},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}}}},
])
def test_strings_refuse_the_control_characters_json_forbids(schema):
    """xgrammar's bounded strings admit raw control characters (its issue 800): ours do not."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from portcullis.engine.core.structured_output import GrammarCompiler
    from portcullis.engine.sampling_params import StructuredOutputsParams

    compiled = GrammarCompiler(AutoTokenizer.from_pretrained(DEMO_MODEL_DIR), 4096).compile(StructuredOutputsParams(json=schema))

    def accepts(value) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        text = json.dumps(value, ensure_ascii=False).replace("\\u001b", "\x1b").replace("\\t", "\t")
        return matcher.accept_string(text) and matcher.is_terminated()

    wrap = (lambda s: {"tags": [s]}) if schema["type"] == "object" else (lambda s: s)
    assert accepts(wrap("ok name"))
    assert not accepts(wrap("esc\u001bape")) and not accepts(wrap("tab\there"))
