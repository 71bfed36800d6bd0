"""Batched sampling over one step's logits: greedy rows by argmax, the rest by temperature,
top-k and top-p, each seeded request drawing from its own generator so its output does not
depend on what else shares the batch."""
from __future__ import annotations

import torch

from engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request], generator: torch.Generator | None = None) -> list[int]:
    """One token per row of `logits` [num_rows, vocab], for `requests` in the same order."""
    logits = logits.float()
    out = torch.argmax(logits, dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        probs = _filtered_probs(logits[rows], [requests[i] for i in random_rows])
        out[rows] = _draw(probs, [requests[i].generator for i in random_rows], generator)
    return out.tolist()


def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    temps = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    top_k = [r.params.top_k for r in requests]
    top_p = [r.params.top_p for r in requests]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([v if 0 < v < vocab else vocab for v in top_k])
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= torch.tensor(top_p).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator | None) -> torch.Tensor:
    out = torch.empty(probs.shape[0], dtype=torch.long)
    for i, gen in enumerate(generators):
        out[i] = torch.multinomial(probs[i], 1, generator=gen or shared).item()
    return out
