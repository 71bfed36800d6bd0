"""Each sampling parameter's effect, checked against a reference computed directly from logits,
and the engine-level features: logprobs against transformers, n > 1, stop strings, structured output."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch

from portcullis.engine import LLM, SamplingParams
from portcullis.engine.sampling_params import StructuredOutputsParams
from portcullis.engine.worker.sampler import (
    BatchSamplingArgs,
    _filtered_probs,
    process_logits,
    sample,
)

VOCAB = 50


@dataclass
class Row:
    """One row's sampling inputs, as the runner keeps them for a request."""

    params: SamplingParams
    prompt: tuple[int, ...]
    outputs: tuple[int, ...]
    eos: tuple[int, ...]


def req(prompt=(1, 2, 3), outputs=(), eos=(), **params) -> Row:
    return Row(SamplingParams(**params), tuple(prompt), tuple(outputs), tuple(eos))


def batch(rows: list[Row], vocab: int = VOCAB) -> BatchSamplingArgs:
    pen = [r.params.uses_penalties for r in rows]
    return BatchSamplingArgs(
        params=[r.params for r in rows],
        num_outputs=[len(r.outputs) for r in rows],
        eos_token_ids=[r.eos for r in rows],
        output_token_ids=[list(r.outputs) if p else None for r, p in zip(rows, pen)],
        prompt_ids=[BatchSamplingArgs.distinct_ids(r.prompt, vocab) if p else None for r, p in zip(rows, pen)],
    )


def filtered(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    return _filtered_probs(logits, [r.params for r in rows])


def sampled(logits: torch.Tensor, rows: list[Row], generator: torch.Generator | None = None):
    return sample(logits, batch(rows, logits.shape[-1]), generator)


def processed(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    return process_logits(logits, batch(rows, logits.shape[-1]))


def logits_row(seed=0) -> torch.Tensor:
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_top_k_keeps_exactly_k_candidates():
    probs = filtered(logits_row(), [req(top_k=5)])
    kept = set(torch.nonzero(probs[0] > 0).flatten().tolist())
    assert kept == set(logits_row()[0].topk(5).indices.tolist())


def test_top_p_keeps_smallest_set_reaching_p():
    raw = logits_row(1)[0]
    probs = filtered(raw[None], [req(top_p=0.6)])[0]
    order = raw.softmax(-1).sort(descending=True)
    cum = order.values.cumsum(0)
    need = int((cum < 0.6).sum()) + 1  # tokens until the mass reaches 0.6
    assert set(torch.nonzero(probs > 0).flatten().tolist()) == set(order.indices[:need].tolist())
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)


def test_min_p_threshold():
    raw = logits_row(2)
    probs = filtered(raw, [req(min_p=0.2)])[0]
    p = raw[0].softmax(-1)
    assert set(torch.nonzero(probs > 0).flatten().tolist()) == set(torch.nonzero(p >= 0.2 * p.max()).flatten().tolist())


def test_temperature_scales_distribution():
    raw = logits_row(3)
    probs = filtered(raw, [req(temperature=0.5)])[0]
    assert torch.allclose(probs, (raw[0] / 0.5).softmax(-1), atol=1e-6)


def reference_probs(row: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                    with_margin=False):
    """The definition, in float64 over the whole sorted vocabulary: temperature, min-p, top-k,
    top-p, each renormalised over what the previous kept. With `with_margin`, also which tokens
    sit so close to a cut (within 1e-4) that float32 rounding may put them on either side."""
    probs = (row.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    keep = probs >= probs[order[(top_k or len(row)) - 1]]  # top-k, ties with the k-th kept
    ratio = probs / probs.max()
    keep &= ratio >= min_p
    near = (ratio - min_p).abs() < 1e-4 if min_p else torch.zeros_like(keep)
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    ranked = probs[order]
    mass_before = ranked.cumsum(0) - ranked
    probs[order[mass_before >= top_p]] = 0.0  # the tokens ranked above already reach top_p
    if top_p < 1:
        near[order[(mass_before - top_p).abs() < 1e-4]] = True
    probs /= probs.sum()
    return (probs, near) if with_margin else probs


LARGE_VOCAB = 5000  # beyond the sampler's 1,024 candidates, so both of its paths run


@pytest.mark.parametrize("shape", ["peaked", "flat"])
@pytest.mark.parametrize("params", [
    dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=40), dict(temperature=0.7, min_p=0.05),
    dict(temperature=1.3, top_k=2000, top_p=0.95), dict(temperature=0.9, min_p=0.001, top_p=0.99),
    dict(temperature=1.0, min_p=0.0001), dict(temperature=1.1, top_k=3, top_p=0.5, min_p=0.01),
])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_truncation_matches_definition_beyond_the_candidates(shape, params, seed):
    # A flat row keeps thousands of tokens (the sampler must notice and sort the whole row);
    # a peaked one keeps a few within its candidates.
    g = torch.Generator().manual_seed(seed)
    scale = 0.05 if shape == "flat" else 4.0
    raw = torch.randn(3, LARGE_VOCAB, generator=g) * scale
    got = filtered(raw, [req(**params) for _ in range(3)])
    for row in range(3):
        want, near = reference_probs(raw[row], **params, with_margin=True)
        differ = (got[row] > 0) ^ (want > 0)
        assert not bool((differ & ~near).any()), f"kept a different set: {int(differ.sum())} tokens"
        both = (got[row] > 0) & (want > 0)
        mine, ref = got[row][both].double(), want[both]
        assert torch.allclose(mine / mine.sum(), ref / ref.sum(), atol=1e-6)


def test_top_k_beyond_the_vocabulary_is_no_limit():
    raw = logits_row(8)
    probs = filtered(raw, [req(temperature=0.7, top_k=VOCAB + 10)])[0]
    assert torch.allclose(probs, (raw[0] / 0.7).softmax(-1), atol=1e-6)


def test_a_row_with_every_token_banned_still_gets_an_id_in_range():
    # The server refuses requests that can get here; the engine must not crash if one does.
    raw = torch.full((3, VOCAB), float("-inf"))
    out = sampled(raw, [req(temperature=1.0), req(temperature=0.8, top_p=0.5), req(temperature=0)])
    assert all(0 <= t < VOCAB for t in out.token_ids)


def test_top_k_keeps_ties_and_a_seeded_draw_ignores_the_batch():
    # bf16 logits tie often. Every token tied with the k-th stays (as vLLM and HF keep them), and a
    # seeded row draws the same token alone or next to rows with other top_k (other candidate counts).
    g = torch.Generator().manual_seed(21)
    rows = (torch.randn(2, LARGE_VOCAB, generator=g) * 3).bfloat16().float()
    mine = dict(temperature=2.0, top_k=6)
    kept = filtered(rows[:1], [req(**mine)])[0] > 0
    assert torch.equal(kept, reference_probs(rows[0], **mine) > 0)
    for seed in range(60):
        alone = sampled(rows[:1].clone(), [req(**mine, seed=seed)]).token_ids[0]
        crowd = sampled(rows.clone(), [req(**mine, seed=seed), req(temperature=1.0, top_k=1000)],
                       torch.Generator().manual_seed(seed)).token_ids[0]
        assert alone == crowd


def test_a_draw_never_returns_a_zero_weight(monkeypatch):
    # On CUDA a parallel cumsum can rise by a rounding error across a zero weight, so the search
    # may point at one; the draw must then pick a token that has weight.
    import portcullis.engine.worker.sampler as sampler

    weights = torch.tensor([[0.5, 0.0, 0.5, 0.0]])
    monkeypatch.setattr(sampler.torch, "searchsorted", lambda *a, **k: torch.tensor([[1]]))
    assert int(sampler._inverse_cdf(weights, torch.tensor([[0.4]]))[0]) in (0, 2)


def test_draws_follow_the_distribution():
    # 20,000 rows of one peaked row in one batch, half with top-k (candidate path) and half
    # plain (whole vocabulary): each token's frequency within 5 standard errors of its probability.
    g = torch.Generator().manual_seed(11)
    row = torch.randn(LARGE_VOCAB, generator=g) * 3
    n = 10_000
    requests = [req(temperature=0.9, top_k=5) for _ in range(n)] + [req(temperature=0.9) for _ in range(n)]
    tokens = torch.tensor(sampled(row.repeat(2 * n, 1), requests, torch.Generator().manual_seed(12)).token_ids)
    for picked, params in ((tokens[:n], dict(temperature=0.9, top_k=5)), (tokens[n:], dict(temperature=0.9))):
        want = reference_probs(row, **params)
        freq = torch.bincount(picked, minlength=LARGE_VOCAB).float() / n
        assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(want).flatten().tolist())
        err = (want * (1 - want) / n).sqrt()
        assert bool((freq - want).abs().le(5 * err + 1e-4).all())


def test_seeded_draw_does_not_depend_on_the_batch():
    # The other rows change how many candidates the batch takes (top_k 2000 widens them) and
    # how many uniform numbers the shared generator hands out.
    g = torch.Generator().manual_seed(13)
    mine = torch.randn(1, LARGE_VOCAB, generator=g) * 2
    others = torch.randn(3, LARGE_VOCAB, generator=g) * 2
    seeded = dict(temperature=1.0, top_p=0.9, top_k=50, seed=7)

    def draw(batch: torch.Tensor, params: list[dict]) -> int:
        return sampled(batch, [req(**p) for p in params], torch.Generator().manual_seed(99)).token_ids[0]

    alone = draw(mine.clone(), [seeded])
    mixed = draw(torch.cat([mine, others]), [seeded, dict(temperature=1.0, top_k=2000), dict(temperature=0.5),
                                             dict(temperature=1.0, min_p=0.1)])
    assert mixed == alone


def test_penalties_change_logits_as_defined():
    raw = logits_row(4)
    r = req(prompt=(1, 2), outputs=(2, 3, 3), presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5)
    got = processed(raw, [r])[0]
    want = raw[0].clone()
    for t in (1, 2, 3):  # repetition: every token seen in prompt or output
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    counts = {2: 1, 3: 2}
    for t, c in counts.items():  # frequency and presence: output tokens only
        want[t] -= 0.25 * c + 0.5
    assert torch.allclose(got, want, atol=1e-6)


def test_penalties_in_a_mixed_batch_match_a_dense_reference():
    # Rows with and without penalties, repeated tokens, tokens in both prompt and output, ids
    # outside the vocabulary: each row changed exactly as the definition says, no other row touched.
    g = torch.Generator().manual_seed(31)
    raw = torch.randn(4, VOCAB, generator=g) * 3
    specs = [
        dict(prompt=(1, 2, 2, 3), outputs=(3, 3, 4), repetition_penalty=1.3, frequency_penalty=0.2),
        dict(prompt=(5, 6), outputs=(7,)),
        dict(prompt=(8, 9, 9, VOCAB + 5), outputs=(9, 10, 10, 10), presence_penalty=0.7, repetition_penalty=0.8),
        dict(prompt=(11,), outputs=(), frequency_penalty=0.5, repetition_penalty=2.0),
    ]
    got = processed(raw, [req(**spec) for spec in specs])
    for row, spec in enumerate(specs):
        want = raw[row].clone()
        rep = spec.get("repetition_penalty", 1.0)
        for t in {*spec["prompt"], *spec["outputs"]} & set(range(VOCAB)):
            want[t] = want[t] / rep if want[t] > 0 else want[t] * rep
        for t in set(spec["outputs"]):
            c = spec["outputs"].count(t)
            want[t] -= spec.get("frequency_penalty", 0.0) * c + spec.get("presence_penalty", 0.0)
        assert torch.allclose(got[row], want, atol=1e-6), row


def test_logit_bias_allowed_bad_and_min_tokens():
    raw = logits_row(5)
    got = processed(raw, [req(logit_bias={7: 100.0})])[0]
    assert int(got.argmax()) == 7 and math.isclose(float(got[7]), float(raw[0, 7]) + 100, rel_tol=1e-6)
    got = processed(raw, [req(allowed_token_ids=[4, 9])])[0]
    assert set(torch.nonzero(torch.isfinite(got)).flatten().tolist()) == {4, 9}
    best = int(raw[0].argmax())
    got = processed(raw, [req(bad_token_ids=[best])])[0]
    assert got[best] == float("-inf")
    got = processed(raw, [req(eos=(best,), min_tokens=2, stop_token_ids=[11])])[0]
    assert got[best] == float("-inf") and got[11] == float("-inf")
    got = processed(raw, [req(outputs=(5, 6), eos=(best,), min_tokens=2)])[0]
    assert torch.isfinite(got[best])  # min_tokens reached: EOS allowed again


def test_batch_rows_do_not_leak_into_each_other():
    raw = torch.cat([logits_row(6), logits_row(6)])
    a, b = req(temperature=0, logit_bias={3: 100.0}), req(temperature=0)
    out = sampled(raw.clone(), [a, b])  # sampled() overwrites the logits it is given
    assert out.token_ids == [3, int(raw[1].argmax())]


def test_logprobs_of_sampled_and_top_tokens():
    raw = logits_row(7)
    out = sampled(raw.clone(), [req(temperature=0, logprobs=3, logit_bias={0: 50.0})])
    lp = raw[0].log_softmax(-1)
    entry = out.logprobs[0]
    assert entry.token_id == 0
    assert math.isclose(entry.logprob, float(lp[0]), abs_tol=1e-6)  # raw distribution, before the bias
    assert entry.rank == int((lp > lp[0]).sum()) + 1
    assert [t for t, _ in entry.top] == lp.topk(3).indices.tolist()


# -- through the engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(checkpoint_factory) -> LLM:
    return LLM(str(checkpoint_factory("llama")), max_model_len=512, kv_cache_memory=32 << 20, dtype="float32")


def test_logprobs_match_transformers(llm, checkpoint_factory):
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 99, 400, 1234, 7, 7, 8]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=5, prompt_logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    ids = torch.tensor([prompt + out.outputs[0].token_ids])
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_factory("llama"), dtype=torch.float32)
    with torch.inference_mode():
        ref = hf(ids).logits[0].log_softmax(-1)
    for i, entry in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + i]
        assert [t for t, _ in entry.top] == row.topk(5).indices.tolist()
        assert max(abs(v - float(row[t])) for t, v in entry.top) < 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[pos]
        assert abs(entry.logprob - float(ref[pos - 1, prompt[pos]])) < 1e-4


def test_n_samples_share_one_prefill(llm):
    prompt = list(range(100, 164))  # four full blocks
    before = llm.engine.stats.num_computed_tokens
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    computed = llm.engine.stats.num_computed_tokens - before
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct seeds, distinct samples
    # The prompt is prefilled once; the two siblings reuse three of its blocks and compute only
    # the last block (16 tokens, since the last prompt token is always recomputed), then decode.
    assert computed == 64 + 2 * 16 + 3 * 4


def test_stop_string_spanning_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(["def f(x):"], greedy, use_tqdm=False)[0].outputs[0]
    # A stop string made of the end of one token's text and the start of the next one's.
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    assert "".join(pieces) == full.text

    def boundary(i: int) -> int:
        return len("".join(pieces[: i + 1]))

    # First boundary whose two-character straddling string does not occur earlier in the text.
    k = next(i for i in range(1, len(pieces) - 1)
             if pieces[i] and pieces[i + 1] and full.text.find(pieces[i][-1] + pieces[i + 1][0]) == boundary(i) - 1)
    stop = pieces[k][-1] + pieces[k + 1][0]
    start = boundary(k) - 1
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:start] and stop not in out.text
    kept = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: start + len(stop)]


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
        "kind": {"enum": ["a", "b", "c"]},
        "inner": {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"], "additionalProperties": False},
    },
    "required": ["ok", "level", "kind", "inner"],
    "additionalProperties": False,
}


def test_structured_json_schema_regex_and_choice(llm):
    import jsonschema

    params = SamplingParams(temperature=1.0, seed=1, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    for out in llm.generate(["{"] * 6, params, use_tqdm=False):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        assert out.outputs[0].finish_reason == "stop"
    regex = SamplingParams(temperature=1.0, seed=2, max_tokens=32, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"))
    import re

    for out in llm.generate(["x"] * 4, regex, use_tqdm=False):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.outputs[0].text)
    choice = SamplingParams(temperature=1.0, seed=3, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe later"]))
    for out in llm.generate(["x"] * 4, choice, use_tqdm=False):
        assert out.outputs[0].text in ("yes", "no", "maybe later")


def test_invalid_schema_is_a_clear_error(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "nonsense-type"}))
    with pytest.raises(ValueError, match="invalid JSON schema"):
        llm.generate(["x"], bad, use_tqdm=False)
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="([a-z")), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
