"""`/v1/embeddings` on a pooling runner: vectors equal transformers' (same pooling) within 1e-4 in
float32, through the official client; whole prompts even when chunked or cached; bad input is a
400 in OpenAI's shape and the server keeps serving."""
from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from portcullis.engine.assets import DEMO_MODEL_DIR
from tests.conftest import _COMMON, MODEL_SPECS, TOKENIZER_FILES
from tests.engine.server.conftest import start_server

# Inputs chosen up front: short and long, code and prose, one that fills several KV blocks.
TEXTS = [
    "hello",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "import os\nprint(os.getcwd())",
]


def build_embedding_checkpoint(out: Path, kind: str, *, base: bool, pooling: str | None = None, **overrides) -> Path:
    """A random-weight decoder saved without (`base`) or with its LM head, optionally with the
    sentence-transformers files that choose mean pooling and normalisation."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    model_type, extra = MODEL_SPECS[kind]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})
    torch.manual_seed(3)
    (AutoModel if base else AutoModelForCausalLM).from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (DEMO_MODEL_DIR / name).is_file():
            shutil.copy(DEMO_MODEL_DIR / name, out / name)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
        (out / "modules.json").write_text(json.dumps(modules))
        (out / "1_Pooling").mkdir()
        (out / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": config.hidden_size, f"pooling_mode_{pooling}": True}))
    return out


def hf_embeddings(path: Path, token_ids: list[list[int]], pooling: str) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in token_ids:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vector = hidden.mean(0) if pooling == "mean_tokens" else hidden[0] if pooling == "cls_token" else hidden[-1]
            out.append(torch.nn.functional.normalize(vector, dim=-1))
    return out


@pytest.fixture(scope="module")
def qwen3_embed(tmp_path_factory):
    path = build_embedding_checkpoint(tmp_path_factory.mktemp("qwen3-embed"), "qwen3", base=True, is_matryoshka=True)
    running = start_server(path, tmp_path_factory.mktemp("embed"), name="embed")
    yield path, running
    running.stop()


def test_last_token_embeddings_equal_transformers(qwen3_embed):
    path, srv = qwen3_embed
    assert srv.core.info.pooling.pooling_type == "last"
    out = srv.client().embeddings.create(model="embed", input=TEXTS)
    tokenizer = srv.state.tokenizer
    ids = [tokenizer.encode(t) for t in TEXTS]
    want = hf_embeddings(path, ids, "lasttoken")
    assert [d.index for d in out.data] == list(range(len(TEXTS)))
    for got, ref in zip(out.data, want):
        assert len(got.embedding) == ref.shape[0]
        assert float((torch.tensor(got.embedding) - ref).abs().max()) < 1e-4
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(i) for i in ids)


def test_token_ids_base64_and_dimensions(qwen3_embed):
    _, srv = qwen3_embed
    client = srv.client()
    ids = srv.state.tokenizer.encode(TEXTS[1])
    floats = client.embeddings.create(model="embed", input=[ids]).data[0].embedding
    assert client.embeddings.create(model="embed", input=TEXTS[1]).data[0].embedding == pytest.approx(floats, abs=1e-6)
    raw = srv.http().post("/v1/embeddings", json={"model": "embed", "input": ids, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(floats, abs=1e-6)
    short = client.embeddings.create(model="embed", input=TEXTS[1], dimensions=16).data[0].embedding
    want = torch.nn.functional.normalize(torch.tensor(floats[:16]), dim=-1)
    assert short == pytest.approx(want.tolist(), abs=1e-5)


def test_mean_pooling_from_sentence_transformers_config_chunked_and_cached(tmp_path_factory):
    # A causal-LM checkpoint run as an embedder (--runner pooling), its pooling chosen by its
    # sentence-transformers files; small chunks, so the mean spans several steps; each input
    # twice, so the second copy could hit the prefix cache (it must still read every position).
    path = build_embedding_checkpoint(tmp_path_factory.mktemp("llama-embed"), "llama", base=False, pooling="mean_tokens")
    srv = start_server(path, tmp_path_factory.mktemp("embed-mean"), name="embed",
                       engine=dict(runner="pooling", max_num_batched_tokens=32))
    try:
        assert srv.core.info.pooling.pooling_type == "mean"
        out = srv.client().embeddings.create(model="embed", input=TEXTS + TEXTS)
        want = hf_embeddings(path, [srv.state.tokenizer.encode(t) for t in TEXTS], "mean_tokens") * 2
        for got, ref in zip(out.data, want):
            assert float((torch.tensor(got.embedding) - ref).abs().max()) < 1e-4
        srv.core.kv.pool.check_integrity()
        assert srv.core.kv.pool.num_free == srv.core.kv.pool.num_blocks
    finally:
        srv.stop()


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": "x " * 600}, "input"),  # past max_model_len (512)
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 65}, "dimensions"),
    ({"input": [[1, 2], "mixed"]}, "input"),
])
def test_bad_embedding_requests_are_400_and_the_server_keeps_serving(qwen3_embed, body, param):
    _, srv = qwen3_embed
    with srv.http() as http:
        r = http.post("/v1/embeddings", json={"model": "embed", **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
        assert http.post("/v1/embeddings", json={"model": "embed", "input": "still here"}).status_code == 200


def test_dimensions_need_a_matryoshka_model(tmp_path_factory):
    path = build_embedding_checkpoint(tmp_path_factory.mktemp("plain-embed"), "qwen2", base=True)
    srv = start_server(path, tmp_path_factory.mktemp("embed-plain"), name="embed")
    try:
        with pytest.raises(openai.BadRequestError, match="Matryoshka"):
            srv.client().embeddings.create(model="embed", input="hi", dimensions=8)
    finally:
        srv.stop()


def test_each_runner_refuses_the_others_routes(qwen3_embed, client):
    # The shared generative server has no embeddings; the embedding server generates no text.
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.embeddings.create(model="tiny-llama", input="hi")
    _, srv = qwen3_embed
    with pytest.raises(openai.BadRequestError, match="embeddings"):
        srv.client().completions.create(model="embed", prompt="hi", max_tokens=2)
    assert srv.client().embeddings.create(model="embed", input="hi").data[0].embedding


def test_offline_embed_equals_transformers(qwen3_embed):
    from portcullis.engine import LLM, PoolingParams

    path, _ = qwen3_embed
    llm = LLM(str(path), max_model_len=512, kv_cache_memory=16 << 20, dtype="float32")
    out = llm.embed(TEXTS, use_tqdm=False)
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    for got, ref, want_ids in zip(out, hf_embeddings(path, ids, "lasttoken"), ids):
        assert got.prompt_token_ids == want_ids
        assert float((torch.tensor(got.outputs.embedding) - ref).abs().max()) < 1e-4
    short = llm.embed(TEXTS[:1], PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    assert len(short) == 8 and abs(float(torch.tensor(short).norm()) - 1.0) < 1e-5
