"""Batched sampling over one step's logits, with per-request parameters.

Order, as vLLM applies it: token constraints (allowed / bad ids, logit bias, min_tokens,
structured-output bitmask), then penalties (repetition over prompt and output, frequency and
presence over output), then greedy argmax, or temperature, min-p, top-k and top-p and a draw.
Each seeded request draws from its own generator, so its output does not depend on what else
shares the batch. Logprobs are taken from the model's raw distribution, before any of this, as
OpenAI reports them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token
    top: list[tuple[int, float]]  # the N most likely (token id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(logits: torch.Tensor, requests: list[Request], generator: torch.Generator | None = None) -> SamplerOutput:
    """One token per row of `logits` [num_rows, vocab], for `requests` in the same order."""
    raw = logits.float()
    # Logprobs are reported from the raw distribution, so it is only overwritten when unneeded.
    keep_raw = any(r.params.logprobs is not None for r in requests)
    logits = process_logits(raw, requests, in_place=not keep_raw)
    tokens = torch.argmax(logits, dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        subset = [requests[i] for i in random_rows]
        probs = _filtered_probs(logits[rows], subset)
        tokens[rows] = _draw(probs, [r.generator for r in subset], generator)
    token_list = tokens.tolist()
    return SamplerOutput(token_list, _logprobs(raw, token_list, requests))


def process_logits(logits: torch.Tensor, requests: list[Request], in_place: bool = False) -> torch.Tensor:
    """`logits` after each row's token constraints and penalties (on a copy unless `in_place`)."""
    if not in_place:
        logits = logits.clone()
    _apply_constraints(logits, requests)
    _apply_penalties(logits, requests)
    return logits


# -- constraints -------------------------------------------------------------------------------
def _apply_constraints(logits: torch.Tensor, requests: list[Request]) -> None:
    vocab = logits.shape[-1]
    for i, req in enumerate(requests):
        p = req.params
        if p.allowed_token_ids is not None:
            keep = torch.tensor([t for t in p.allowed_token_ids if 0 <= t < vocab], dtype=torch.long)
            allowed = torch.full((vocab,), float("-inf"))
            allowed[keep] = 0.0
            logits[i] += allowed
        if p.bad_token_ids:
            logits[i, [t for t in p.bad_token_ids if 0 <= t < vocab]] = float("-inf")
        if p.logit_bias:
            ids = [t for t in p.logit_bias if 0 <= t < vocab]
            logits[i, ids] += torch.tensor([p.logit_bias[t] for t in ids])
        if req.num_output_tokens < p.min_tokens:
            banned = [t for t in (*req.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
            logits[i, banned] = float("-inf")
    _apply_grammar(logits, requests)


def _apply_grammar(logits: torch.Tensor, requests: list[Request]) -> None:
    rows = [i for i, r in enumerate(requests) if r.matcher is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(requests), logits.shape[-1])
    for i in rows:
        requests[i].matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    rows = [i for i, r in enumerate(requests) if r.params.uses_penalties]
    if not rows:
        return
    vocab = logits.shape[-1]
    counts = torch.stack([_bincount(requests[i].output_token_ids, vocab) for i in rows])
    in_prompt = torch.stack([_bincount(requests[i].prompt_token_ids, vocab) > 0 for i in rows])
    rep = torch.tensor([requests[i].params.repetition_penalty for i in rows]).unsqueeze(1)
    freq = torch.tensor([requests[i].params.frequency_penalty for i in rows]).unsqueeze(1)
    pres = torch.tensor([requests[i].params.presence_penalty for i in rows]).unsqueeze(1)
    sub = logits[rows]
    seen = in_prompt | (counts > 0)
    # Repetition penalty as in CTRL / Hugging Face: shrink positive logits, push negative ones down.
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits[rows] = sub


def _bincount(token_ids: list[int], vocab: int) -> torch.Tensor:
    if not token_ids:
        return torch.zeros(vocab)
    return torch.bincount(torch.tensor(token_ids).clamp(0, vocab - 1), minlength=vocab)[:vocab].float()


# -- random sampling ---------------------------------------------------------------------------
def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    temps = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    min_p = torch.tensor([r.params.min_p for r in requests], dtype=logits.dtype)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    top_k = [r.params.top_k for r in requests]
    top_p = [r.params.top_p for r in requests]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([v if 0 < v < vocab else vocab for v in top_k])
    drop = torch.arange(vocab).unsqueeze(0) >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator | None) -> torch.Tensor:
    out = torch.empty(probs.shape[0], dtype=torch.long)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        out[unseeded] = torch.multinomial(probs[unseeded], 1, generator=shared).squeeze(1)
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i] = torch.multinomial(probs[i], 1, generator=gen).item()
    return out


# -- logprobs ------------------------------------------------------------------------------------
def _logprobs(raw: torch.Tensor, tokens: list[int], requests: list[Request]) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return out
    lp = torch.log_softmax(raw[rows], dim=-1)
    n = max(requests[i].params.logprobs for i in rows)
    top_lp, top_ids = lp.topk(max(n, 1), dim=-1)
    chosen = torch.tensor([tokens[i] for i in rows])
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen_lp.unsqueeze(1)).sum(dim=-1) + 1
    for j, i in enumerate(rows):
        k = requests[i].params.logprobs
        top = list(zip(top_ids[j, :k].tolist(), top_lp[j, :k].tolist()))
        out[i] = TokenLogprobs(tokens[i], float(chosen_lp[j]), int(ranks[j]), top)
    return out


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], n: int) -> list[TokenLogprobs]:
    """Logprobs of each actual next prompt token under the logits of the position before it."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(next_tokens)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen_lp.unsqueeze(1)).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(max(n, 1), dim=-1)
    return [
        TokenLogprobs(t, float(chosen_lp[j]), int(ranks[j]), list(zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist())))
        for j, t in enumerate(next_tokens)
    ]
