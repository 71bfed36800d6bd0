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
    tokens = torch.empty(len(requests), dtype=torch.long)
    greedy_rows = [i for i, r in enumerate(requests) if r.params.greedy]
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if len(greedy_rows) == len(requests):
        tokens = torch.argmax(logits, dim=-1)
    elif greedy_rows:
        tokens[greedy_rows] = torch.argmax(logits[greedy_rows], dim=-1)
    if random_rows:
        subset = [requests[i] for i in random_rows]
        tokens[random_rows] = _draw(_filtered_logits(logits[random_rows], subset), subset, generator)
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
    counts = _token_counts([requests[i].output_token_ids for i in rows], vocab)
    in_prompt = _token_counts([requests[i].prompt_token_ids for i in rows], vocab) > 0
    rep = torch.tensor([requests[i].params.repetition_penalty for i in rows]).unsqueeze(1)
    freq = torch.tensor([requests[i].params.frequency_penalty for i in rows]).unsqueeze(1)
    pres = torch.tensor([requests[i].params.presence_penalty for i in rows]).unsqueeze(1)
    sub = logits[rows]
    seen = in_prompt | (counts > 0)
    # Repetition penalty as in CTRL / Hugging Face: shrink positive logits, push negative ones down.
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits[rows] = sub


def _token_counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """[len(token_lists), vocab] occurrence counts, built with one scatter for the whole batch."""
    counts = torch.zeros(len(token_lists), vocab)
    lengths = torch.tensor([len(t) for t in token_lists])
    if int(lengths.sum()) == 0:
        return counts
    row = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    tok = torch.tensor([t for ids in token_lists for t in ids]).clamp(0, vocab - 1)
    counts.index_put_((row, tok), torch.ones(len(tok)), accumulate=True)
    return counts


# -- random sampling ---------------------------------------------------------------------------
def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    return _filtered_logits(logits.clone(), requests).softmax(dim=-1)


def _filtered_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:  # modifies `logits`
    """Temperature, then min-p, top-k and top-p, each only on the rows that use it (a full-vocabulary
    sort is the most expensive thing here, so it is kept to the top-p rows)."""
    temps = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype)
    logits = logits.div_(temps.unsqueeze(1))  # `logits` is already this function's own copy
    rows = [j for j, r in enumerate(requests) if r.params.min_p > 0]
    if rows:
        sub = logits[rows]
        probs = sub.softmax(dim=-1)
        min_p = torch.tensor([requests[j].params.min_p for j in rows], dtype=logits.dtype).unsqueeze(1)
        logits[rows] = sub.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    rows = [j for j, r in enumerate(requests) if 0 < r.params.top_k < logits.shape[-1]]
    if rows:
        logits[rows] = _top_k(logits[rows], [requests[j].params.top_k for j in rows])
    rows = [j for j, r in enumerate(requests) if r.params.top_p < 1.0]
    if rows:
        logits[rows] = _top_p(logits[rows], [requests[j].params.top_p for j in rows])
    return logits


def _top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    k = torch.tensor(top_k).unsqueeze(1)
    values = logits.topk(max(top_k), dim=-1).values
    kth = values.gather(1, k - 1)
    return logits.masked_fill(logits < kth, float("-inf"))


_TOP_P_CANDIDATES = 1024


def _top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p. A model's nucleus
    almost always lies within its top 1,024 tokens; only rows where it does not pay for a sort
    of the whole vocabulary."""
    p = torch.tensor(top_p, dtype=logits.dtype).unsqueeze(1)
    k = min(_TOP_P_CANDIDATES, logits.shape[-1])
    values, index = logits.topk(k, dim=-1)
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(-1, index, _nucleus(values, probs, p))
    wide = torch.nonzero(probs.sum(dim=-1, keepdim=True) < p)[:, 0].tolist()
    if wide:
        values, index = logits[wide].sort(dim=-1, descending=True)
        probs = values.softmax(dim=-1)
        out[wide] = torch.full_like(values, float("-inf")).scatter(-1, index, _nucleus(values, probs, p[wide]))
    return out


def _nucleus(sorted_logits: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    return sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))


def _draw(logits: torch.Tensor, requests: list[Request], shared: torch.Generator | None) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform number per row, from the request's own generator when
    it has one (so its draws do not depend on the batch), else from the shared one. One cumsum
    over the vocabulary is far cheaper than multinomial or a random number per token."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    u = torch.empty(len(requests), 1)
    unseeded = [j for j, r in enumerate(requests) if r.generator is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), 1, generator=shared)
    for j, r in enumerate(requests):
        if r.generator is not None:
            u[j] = torch.rand(1, generator=r.generator)
    # right=True: the first token whose cumulative mass exceeds u, so never a zero-probability one.
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return picked.squeeze(1).clamp(max=logits.shape[-1] - 1)


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
