"""Real trained weights (issue 31): SmolLM2-135M-Instruct and Gemma 3 270M, from the GGUF files
`make setup` fetched and from Hugging Face folders converted out of them, give transformers'
greedy tokens (float32): the files with prefix caching off, with chunked prefill over shared cached
prefixes, and under preemption; the folders (a question for the loader, not the scheduler) with
prefix caching off.

transformers reads the same GGUF file (dequantized to float32) and is the reference. Trained
weights can make a greedy pick a near-tie that rounding flips; such a pair is judged by vLLM's
`check_logprobs_close` rule: at the first difference each side's token is among the other's top-5,
and the rest of the sequence is not compared. The prompts were chosen before any output was seen:
chat prompts through SmolLM2's own template, plain prompts for the Gemma 3 base model.
"""
from __future__ import annotations

import shutil

import pytest

from portcullis.engine import LLM, SamplingParams
from portcullis.engine.assets import GEMMA3, SMOLLM2
from tests.support.real_models import NEW_TOKENS, TOP, real_file

MODES = {
    "no-prefix-cache": dict(enable_prefix_caching=False),
    # 32-token chunks, and every prompt shares its first block(s) (the template, the system prompt)
    "chunked-prefill+prefix-cache": dict(enable_prefix_caching=True, max_num_batched_tokens=32),
    "preemption": dict(enable_prefix_caching=True),  # and a pool too small for all six at once
}


def compare(engine_outs, expected) -> int:
    """vLLM's check_logprobs_close; returns how many sequences matched exactly."""
    exact = 0
    for i, (out, (want, want_top)) in enumerate(zip(engine_outs, expected)):
        got = out.outputs[0].token_ids
        got_top = [dict(step.top) for step in out.outputs[0].logprobs]
        diverged = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if diverged is None:  # both stopped at the end-of-sequence token, or both at NEW_TOKENS
            assert len(got) == len(want), f"prompt {i}: {got} against {want}"
            exact += 1
            continue
        a, b = got[diverged], want[diverged]
        assert a in want_top[diverged] and b in got_top[diverged], (
            f"prompt {i} differs at token {diverged}: engine {a} (top-{TOP} of transformers: {want_top[diverged]}), "
            f"transformers {b} (top-{TOP} of the engine: {got_top[diverged]})")
    return exact


@pytest.mark.parametrize("fmt", ["gguf", "folder"])
@pytest.mark.parametrize("model", [SMOLLM2, GEMMA3], ids=["smollm2", "gemma3"])
def test_greedy_tokens_match_transformers(model, fmt, reference):
    ref = reference(model)
    source, prompts = (ref.source if fmt == "gguf" else ref.folder), ref.prompts
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=TOP)  # stops at EOS, as generate does
    exact, per_block = {}, None
    # The folder is the loader's question: one mode answers it; the file runs them all.
    modes = MODES if fmt == "gguf" else {"no-prefix-cache": MODES["no-prefix-cache"]}
    for mode, settings in modes.items():
        settings = dict(settings)
        if mode == "preemption":  # room for about a third of the six at once
            settings["kv_cache_memory"] = per_block * sum(-(-(len(p) + NEW_TOKENS) // 16) for p in prompts) // 3
        llm = LLM(str(source), dtype="float32", max_model_len=512, seed=0,
                  **{"kv_cache_memory": 64 << 20, **settings})
        per_block = llm.engine.model_runner.kv_bytes_per_block()
        cached_run = mode == "chunked-prefill+prefix-cache"
        for _ in range(2 if cached_run else 1):  # the second run is served from the cache
            outs = llm.generate(prompts, params, use_tqdm=False)
            exact[mode] = compare(outs, ref.outputs)
        if model is SMOLLM2:
            assert "Paris" in outs[0].outputs[0].text
        if mode == "preemption":
            assert llm.engine.stats.num_preemptions > 0
        if cached_run:
            assert llm.engine.stats.prefix_cache_hits >= sum(len(p) // 16 * 16 for p in prompts)  # the second run
        llm.engine.kv.pool.check_integrity()
        del llm
    print(f"{model.file} ({fmt}): sequences exact of {len(prompts)} per mode: {exact}")


def test_llm_chat_answers_through_the_models_own_template():
    """`LLM.chat` as vLLM's: conversations rendered by the GGUF file's chat template (SmolLM2's
    ChatML with its default system prompt), the assistant's turn opened, the reply stopping at
    the template's end-of-turn token."""
    llm = LLM(str(real_file(SMOLLM2)), dtype="float32", max_model_len=512, kv_cache_memory=32 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    (one,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy, use_tqdm=False)
    assert "Paris" in one.outputs[0].text and one.outputs[0].finish_reason == "stop"
    assert llm.tokenizer.decode(one.prompt_token_ids).startswith("<|im_start|>system\n")
    assert llm.tokenizer.decode(one.prompt_token_ids).endswith("<|im_start|>assistant\n")
    both = llm.chat([[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "user", "content": "List three primary colors."}]], greedy, use_tqdm=False)
    assert both[0].outputs[0].token_ids == one.outputs[0].token_ids and len(both) == 2


def test_a_tokenizer_override_replaces_the_files_own(reference, tmp_path):
    """`--tokenizer` / `LLM(..., tokenizer=DIR)` as vLLM's: the GGUF's weights with another folder's
    tokenizer and chat template (here a copy of SmolLM2's with its chat template replaced)."""
    ref = reference(SMOLLM2)
    folder = tmp_path / "tokenizer"
    shutil.copytree(ref.folder, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    llm = LLM(str(ref.source), tokenizer=str(folder), dtype="float32", max_model_len=512, kv_cache_memory=32 << 20)
    assert llm.engine.info.tokenizer == str(folder)
    (out,) = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.tokenizer.decode(out.prompt_token_ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
