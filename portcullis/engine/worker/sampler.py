"""Batched sampling over one step's logits, with per-request parameters.

Order, as vLLM applies it: token constraints (allowed / bad ids, logit bias, min_tokens,
structured-output bitmask), then penalties (repetition over prompt and output, frequency and
presence over output), then greedy argmax, or temperature, min-p, top-k and top-p and a draw.
Rows that truncate draw from their most likely candidates only, and penalties touch only the
tokens a row has seen, so few passes run over the whole vocabulary (151,936 entries a row for
Qwen). A seeded request's k-th draw is a function of its seed and k alone, so its output does not
depend on what else shares the batch, nor on preemptions. Logprobs are taken from the model's raw
distribution, before any of this, as OpenAI reports them.

The sampler sees no requests: the runner builds one `BatchSamplingArgs` per step from its own state.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from portcullis.engine.sampling_params import SamplingParams


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token
    top: list[tuple[int, float]]  # the N most likely (token id, logprob), best first


@dataclass
class BatchSamplingArgs:
    """One step's sampling inputs; entry i of each list belongs to row i of the logits."""

    params: list[SamplingParams]
    num_outputs: list[int]  # tokens each row has produced so far (min_tokens; a seeded row's draw index)
    eos_token_ids: list[tuple[int, ...]]  # banned with stop_token_ids until min_tokens; empty with ignore_eos
    output_token_ids: list[Sequence[int] | None]  # rows with penalties: their outputs so far; else None
    prompt_ids: list[torch.Tensor | None]  # rows with penalties: their prompt's distinct in-vocab ids
    bitmask_rows: list[int] = field(default_factory=list)  # rows under a grammar, in `bitmask` order
    bitmask: torch.Tensor | None = None  # their allowed tokens (xgrammar's packed layout)

    def __post_init__(self) -> None:
        self.greedy_rows = [i for i, p in enumerate(self.params) if p.greedy]
        self.random_rows = [i for i, p in enumerate(self.params) if not p.greedy]
        self.penalty_rows = [i for i, p in enumerate(self.params) if p.uses_penalties]
        self.logprob_rows = [i for i, p in enumerate(self.params) if p.logprobs is not None]

    @staticmethod
    def distinct_ids(token_ids: Sequence[int], vocab: int) -> torch.Tensor:
        """The distinct in-vocabulary ids of `token_ids` (a prompt's, for repetition penalties)."""
        ids = torch.tensor(token_ids, dtype=torch.long).unique()
        return ids[(ids >= 0) & (ids < vocab)]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(logits: torch.Tensor, args: BatchSamplingArgs, generator: torch.Generator | None = None) -> SamplerOutput:
    """One token per row of `logits` [num_rows, vocab], row i sampled as `args` says for row i.
    `logits` is overwritten: it is this step's own, and a copy of the whole batch would cost more
    than any other part of sampling."""
    logits = logits.float()
    raw_logprobs = _raw_logprobs(logits, args)  # before processing overwrites the raw rows
    process_logits(logits, args, in_place=True)
    greedy, rows = args.greedy_rows, args.random_rows
    if not rows:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.zeros(len(args.params), dtype=torch.long, device=logits.device)
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        u = _uniforms(args, rows, generator).to(logits.device)
        for draw in _distributions(logits, args.params, rows):
            tokens[draw.rows] = draw.pick(u[draw.rows])
    token_list = tokens.tolist()
    return SamplerOutput(token_list, _logprobs(raw_logprobs, token_list, args))


def process_logits(logits: torch.Tensor, args: BatchSamplingArgs, in_place: bool = False) -> torch.Tensor:
    """`logits` after each row's token constraints and penalties (on a copy unless `in_place`)."""
    if not in_place:
        logits = logits.clone()
    _apply_constraints(logits, args)
    _apply_penalties(logits, args)
    return logits


# -- constraints -------------------------------------------------------------------------------
def _apply_constraints(logits: torch.Tensor, args: BatchSamplingArgs) -> None:
    vocab, device = logits.shape[-1], logits.device
    for i, p in enumerate(args.params):
        if p.allowed_token_ids is not None:
            allowed = torch.full((vocab,), float("-inf"), device=device)
            allowed[[t for t in p.allowed_token_ids if 0 <= t < vocab]] = 0.0
            logits[i] += allowed
        if p.bad_token_ids:
            logits[i, [t for t in p.bad_token_ids if 0 <= t < vocab]] = float("-inf")
        if p.logit_bias:
            ids = [t for t in p.logit_bias if 0 <= t < vocab]
            logits[i, ids] += torch.tensor([p.logit_bias[t] for t in ids], device=device)
        if args.num_outputs[i] < p.min_tokens:
            banned = [t for t in (*args.eos_token_ids[i], *p.stop_token_ids) if 0 <= t < vocab]
            logits[i, banned] = float("-inf")
    _apply_grammar(logits, args)


def _apply_grammar(logits: torch.Tensor, args: BatchSamplingArgs) -> None:
    if not args.bitmask_rows:
        return
    import xgrammar as xgr

    # xgrammar indexes the bitmask like the logits: spread the constrained rows' into a full one.
    full = torch.full((logits.shape[0], args.bitmask.shape[1]), -1, dtype=args.bitmask.dtype)
    full[args.bitmask_rows] = args.bitmask
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), indices=args.bitmask_rows)


def _apply_penalties(logits: torch.Tensor, args: BatchSamplingArgs) -> None:
    """Repetition (over prompt and output), frequency and presence (over output) penalties,
    touching only the tokens each row has seen. A prompt's distinct ids are computed once per
    request, so a step's work follows its new tokens, not the length of the context."""
    rows = args.penalty_rows
    if not rows:
        return
    vocab, n, device = logits.shape[-1], len(rows), logits.device
    # Keys are j * vocab + token, with j the row's place in `rows`: unique (row, token) pairs.
    prompt = torch.cat([args.prompt_ids[i] + j * vocab for j, i in enumerate(rows)])
    emitted, counts = _row_token_keys([args.output_token_ids[i] for i in rows], vocab).unique(return_counts=True)
    in_prompt = torch.zeros(n * vocab, dtype=torch.bool)
    in_prompt[prompt] = True
    seen = torch.cat([prompt, emitted[~in_prompt[emitted]]])  # each (row, token) of prompt or output once
    batch_row = torch.tensor(rows)
    params = [args.params[i] for i in rows]
    rep = torch.tensor([p.repetition_penalty for p in params])
    row, tok, factor = (t.to(device) for t in (batch_row[seen // vocab], seen % vocab, rep[seen // vocab]))
    values = logits[row, tok]
    # Repetition penalty as in CTRL / Hugging Face: shrink positive logits, push negative ones down.
    logits[row, tok] = torch.where(values > 0, values / factor, values * factor)
    freq = torch.tensor([p.frequency_penalty for p in params])
    pres = torch.tensor([p.presence_penalty for p in params])
    j = emitted // vocab
    row, tok, cut = (t.to(device) for t in (batch_row[j], emitted % vocab, freq[j] * counts + pres[j]))
    logits[row, tok] -= cut


def _row_token_keys(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """j * vocab + token for every in-vocabulary token of list j, flattened."""
    lengths = torch.tensor([len(t) for t in token_lists])
    row = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    tok = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.long)
    valid = (tok >= 0) & (tok < vocab)
    return (row * vocab + tok)[valid]


# -- random sampling ---------------------------------------------------------------------------
# A model's nucleus almost always lies within its 1,024 most likely tokens; a row whose kept set
# does not is redone over its whole vocabulary (see _truncated).
_CANDIDATES = 1024


@dataclass
class _Draw:
    """The distribution some of the batch's `rows` are drawn from: unnormalised `weights` over
    the candidate token `ids` (most likely first) or, when `ids` is None, over the whole vocabulary."""

    rows: list[int]
    weights: torch.Tensor
    ids: torch.Tensor | None = None

    def pick(self, u: torch.Tensor) -> torch.Tensor:
        index = _inverse_cdf(self.weights, u)
        return index if self.ids is None else self.ids.gather(1, index.unsqueeze(1)).squeeze(1)

    def dense(self, vocab: int) -> torch.Tensor:
        probs = self.weights / self.weights.sum(dim=-1, keepdim=True)
        return probs if self.ids is None else probs.new_zeros(len(self.rows), vocab).scatter_(1, self.ids, probs)


def _distributions(logits: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> list[_Draw]:
    """What each of the random `rows` is drawn from: logits / temperature, then min-p, top-k and
    top-p, each on what the one before kept, renormalised. Rows that truncate are drawn from their
    most likely candidates only, so they pay for no full-vocabulary softmax, cumsum or sort.
    `logits` itself is left as it is."""
    vocab = logits.shape[-1]
    whole: list[int] = []
    by_width: dict[int, list[int]] = {}
    for i in rows:
        p = params[i]
        if _truncates(p, vocab):
            by_width.setdefault(_width(p, vocab), []).append(i)
        else:
            whole.append(i)
    draws = [_Draw(whole, _weights(logits[whole], [params[i] for i in whole]))] if whole else []
    # A row's candidates depend on its own parameters only, so what it keeps, and the order it
    # draws in, never depend on what else shares the batch (nor does one huge top_k slow the rest).
    for width, group in by_width.items():
        draws += _truncated(logits[group], group, [params[i] for i in group], width)
    return draws


def _truncates(p, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0


def _width(p, vocab: int) -> int:
    """Candidates a truncating row takes: top_k and one more (to see a tie at the cut), else 1,024."""
    return min(vocab, p.top_k + 1 if 0 < p.top_k < vocab else _CANDIDATES)


def _weights(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:  # overwrites `logits`
    """Unnormalised probabilities (p / p_max) of logits / temperature, over the whole vocabulary."""
    temps = _column([p.temperature for p in params], logits.device)
    return logits.sub_(logits.amax(dim=-1, keepdim=True)).div_(temps).exp_()


def _floored_weights(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:  # overwrites `logits`
    """Whole-vocabulary weights with what min-p drops (p < min_p * p_max) set to zero."""
    weights = _weights(logits, params)
    return weights.masked_fill_(weights < _column([p.min_p for p in params], logits.device), 0.0)


def _truncated(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], width: int) -> list[_Draw]:
    """Draws for rows that use top-k, top-p or min-p, from each row's `width` most likely tokens.
    A row whose kept set reaches past them is redone: over its whole vocabulary, masked, when
    only min-p cuts it (no order needed), else over its fully sorted vocabulary."""
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    values, ids = logits.topk(width, dim=-1)  # sorted, most likely first
    weights, exact = _kept_weights(values, logits, params, top_k)
    if bool(exact.all()):
        return [_Draw(rows, weights, ids)]
    done = torch.nonzero(exact).flatten().tolist()
    rest = torch.nonzero(~exact).flatten().tolist()
    draws = [_Draw([rows[j] for j in done], weights[done], ids[done])] if done else []
    floored = [j for j in rest if params[j].top_p >= 1 and top_k[j] == vocab]
    if floored:
        draws.append(_Draw([rows[j] for j in floored], _floored_weights(logits[floored], [params[j] for j in floored])))
    if sort := [j for j in rest if j not in floored]:
        draws += _truncated(logits[sort], [rows[j] for j in sort], [params[j] for j in sort], vocab)
    return draws


def _kept_weights(values: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams],
                  top_k: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities over the sorted candidate logits `values` after min-p, top-k and top-p (0 where
    dropped), and per row whether they are exact: whether all that the row keeps is a candidate."""
    k, device = values.shape[-1], values.device
    temps = _column([p.temperature for p in params], device)
    v = values / temps
    limit = torch.tensor(top_k, device=device).unsqueeze(1)
    # top-k keeps every token tied with the k-th, as vLLM and Hugging Face do (ties are common in bf16).
    kth = v.gather(1, (limit - 1).clamp(max=k - 1)).masked_fill_(limit > k, -math.inf)
    floor = v[:, :1] + _column([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device)
    keep = (v >= kth) & (v >= floor)  # min-p: p >= min_p * p_max, in log space
    # Both cuts keep a prefix of the sorted tokens: it ends among the candidates unless the last one is kept.
    inside = ~keep[:, -1] | torch.isneginf(v[:, -1]) | (k == logits.shape[-1])
    v = v.masked_fill(~keep, -math.inf)
    norm = v.logsumexp(dim=-1, keepdim=True)
    outside = torch.nonzero(~inside).flatten().tolist()
    if outside:  # top-p's mass is relative to all that min-p kept, candidate or not
        whole = logits[outside].div_(temps[outside])
        if any(params[j].min_p > 0 for j in outside):
            whole.masked_fill_(whole < floor[outside], -math.inf)
        norm[outside] = whole.logsumexp(dim=-1, keepdim=True)
    probs = (v - norm).exp()
    cum = probs.cumsum(dim=-1)
    top_p = _column([p.top_p if p.top_p < 1 else math.inf for p in params], device)
    keep &= cum - probs < top_p  # top-p: drop a token once those ranked above it reach top_p
    exact = inside | (cum[:, -1:] >= top_p).squeeze(1)
    return probs.masked_fill_(~keep, 0.0), exact


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose running total of `weights` exceeds u x the total: a draw in
    proportion to the weights that never lands on a zero one. One cumsum is far cheaper than
    multinomial or a random number per token."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    x = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))  # u < 1, yet u x total may round up
    # A row with no finite weight (every token banned) has a NaN total: it still gets an id in range.
    index = torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=weights.shape[-1] - 1)
    # A parallel cumsum (CUDA's) may rise by a rounding error across a zero weight: never pick one.
    zero = weights.gather(1, index.unsqueeze(1)).squeeze(1) <= 0
    if bool(zero.any()):
        index[zero] = weights[zero].argmax(dim=-1)
    return index


def _uniforms(args: BatchSamplingArgs, rows: list[int], shared: torch.Generator | None) -> torch.Tensor:
    """[len(params), 1]: one uniform number per random row: a seeded row's from its seed and draw
    index alone (so its draws depend neither on the batch nor on preemptions), the others' from
    the shared generator."""
    u = torch.zeros(len(args.params), 1)
    unseeded = [i for i in rows if args.params[i].seed is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), 1, generator=shared)
    for i in rows:
        if args.params[i].seed is not None:
            u[i] = seeded_uniform(args.params[i].seed, args.num_outputs[i])
    return u


def seeded_uniform(seed: int, index: int) -> float:
    """The `index`-th uniform number in [0, 1) of `seed`'s stream: a keyed hash of the pair, as
    counter-based generators do, so any draw can be made without the ones before it. 24 bits:
    every value is exact in float32 and below 1."""
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8, key=(seed % 2**64).to_bytes(8, "little")).digest()
    return (int.from_bytes(digest, "little") >> 40) * 2.0**-24


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each (random) row is drawn from, dense [rows, vocab]; built by the code
    that sampling uses, so tests can check it against a reference."""
    out = torch.zeros_like(logits)
    for draw in _distributions(logits, params, list(range(len(params)))):
        out[draw.rows] = draw.dense(logits.shape[-1])
    return out


# -- logprobs ------------------------------------------------------------------------------------
def _raw_logprobs(logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor | None:
    rows = args.logprob_rows
    return torch.log_softmax(logits[rows], dim=-1) if rows else None


def _logprobs(lp: torch.Tensor | None, tokens: list[int], args: BatchSamplingArgs) -> list[TokenLogprobs | None]:
    """From `lp`, the raw log-probabilities of the rows that asked for logprobs, in batch order."""
    out: list[TokenLogprobs | None] = [None] * len(args.params)
    rows = args.logprob_rows
    if not rows:
        return out
    n = max(args.params[i].logprobs for i in rows)
    top_lp, top_ids = lp.topk(max(n, 1), dim=-1)
    chosen = torch.tensor([tokens[i] for i in rows], device=lp.device)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen_lp.unsqueeze(1)).sum(dim=-1) + 1
    for j, i in enumerate(rows):
        k = args.params[i].logprobs
        top = list(zip(top_ids[j, :k].tolist(), top_lp[j, :k].tolist()))
        out[i] = TokenLogprobs(tokens[i], float(chosen_lp[j]), int(ranks[j]), top)
    return out


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], n: int) -> list[TokenLogprobs]:
    """Logprobs of each actual next prompt token under the logits of the position before it."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(next_tokens, device=lp.device)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen_lp.unsqueeze(1)).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(max(n, 1), dim=-1)
    return [
        TokenLogprobs(t, float(chosen_lp[j]), int(ranks[j]), list(zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist())))
        for j, t in enumerate(next_tokens)
    ]
