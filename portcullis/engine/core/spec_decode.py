"""Speculative decoding (vLLM's `--speculative-config`). With `"method": "ngram"` each decoding
request proposes up to K tokens found by matching its last n tokens (n from `prompt_lookup_max`
down to `prompt_lookup_min`) earlier in its own prompt and output; with `"method": "draft_model"`
a small model of the same vocabulary proposes them (`DraftModel`, run by the model runner). The
runner scores all proposals in the step's one forward pass, and the longest prefix the target
model itself produces is kept.

Verification draws each position's token exactly as plain decoding would (greedy argmax, or the
position's own uniform number against the filtered distribution) and keeps proposals while they
equal it. For a proposal that is one fixed token this is Leviathan et al.'s rejection rule
(accept with probability p(x); on rejection the token comes from p without x), done with one
uniform number: the output distribution is unchanged, and a seeded or greedy request gives
exactly the tokens it gives without speculation.

Predicted Outputs (OpenAI's `prediction`) use the same path with the client's text as the
source: the first tokens of the prediction, then what follows the output's latest n-gram in it.

Under structured output, n-gram and prediction proposals are cut at the first token the grammar
refuses (and before one that would end it), and each scored position samples under the mask of
the grammar state the proposals before it lead to (`StructuredOutputManager.bitmask`); a draft
model proposes nothing for such a request (it would draft without the grammar).
"""
from __future__ import annotations

from array import array

import numpy as np

from portcullis.engine.config import SpeculativeConfig

# Proposals per step for a request with a prediction on an engine without --speculative-config.
PREDICTION_TOKENS = 8


def propose(token_ids: list[int], config: SpeculativeConfig, limit: int, packed: bytearray | None = None) -> list[int]:
    """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix
    of `token_ids` (between the lookup bounds) that occurs earlier; [] when none does.
    `packed`: the caller's buffer of `token_ids` as bytes, brought up to date here (token ids
    only grow), so a long context is not packed again at every step."""
    k = min(limit, config.num_speculative_tokens)
    if packed is not None and len(packed) < 4 * len(token_ids):
        packed += array("i", token_ids[len(packed) // 4 :]).tobytes()
    return _lookup(token_ids, token_ids, config.prompt_lookup_max, config.prompt_lookup_min, k, exclude_tail=True,
                   data=packed)


def propose_from_prediction(prediction: list[int], output: list[int], config: SpeculativeConfig | None,
                            limit: int) -> list[int]:
    """The client's predicted output as proposals: while the output follows the prediction
    position by position, the prediction's next tokens; once it has strayed, what follows the
    output's longest suffix (up to 8 tokens) where it last occurs in the prediction."""
    k = min(limit, config.num_speculative_tokens if config else PREDICTION_TOKENS)
    if k < 1:
        return []
    at = len(output)
    if prediction[max(0, at - 8) : at] == output[-8:] and at < len(prediction):  # still on track
        return prediction[at : at + k]
    return _lookup(prediction, output, 8, 1, k, exclude_tail=False)


def _lookup(source: list[int], context: list[int], n_max: int, n_min: int, k: int, exclude_tail: bool,
            data: bytes | bytearray | None = None) -> list[int]:
    """The `k` tokens of `source` after the latest occurrence of `context`'s longest suffix of
    n_max..n_min tokens (when `source` is `context`, not the suffix itself); `data`: `source`
    packed as 4-byte ints, when the caller has it."""
    if k < 1 or len(context) < n_min + exclude_tail:
        return []
    # Searched as bytes: rfind runs at C speed, where a Python scan of a long prompt would not.
    data = array("i", source).tobytes() if data is None else data
    tail = array("i", context[-n_max:]).tobytes()
    for n in range(min(n_max, len(context) - exclude_tail), n_min - 1, -1):
        # Only matches with a token after them (which also keeps `context`'s own suffix out).
        start = _rfind_aligned(data, tail[-4 * n :], len(data) - 4)
        if start is not None:
            first = start // 4 + n
            return source[first : first + k]
    return []


# A byte match that starts inside a token (bytes.rfind knows no tokens) is rare in real text, but
# content built for it has one at every token: 1 1 1 lies across each boundary of 256 256 256
# (00 01 00 00 | 00 01 ...). Past this many such matches the search compares whole tokens instead,
# so a lookup costs a bounded number of operations whatever the content (a prediction of 2,040 x
# token 256 against an output of token 1 made 32,588 calls, 2-3 ms, on the engine thread).
MISALIGNED_MATCHES = 8


def _rfind_aligned(data: bytes, pattern: bytes, end: int) -> int | None:
    """The last byte offset, a multiple of 4, where `pattern` starts and ends by `end`."""
    for _ in range(MISALIGNED_MATCHES):
        at = data.rfind(pattern, 0, end)
        if at < 0:
            return None
        if at % 4 == 0:
            return at
        end = at + len(pattern) - 1
    return _rfind_tokens(data, pattern, end)


def _rfind_tokens(data: bytes, pattern: bytes, end: int) -> int | None:
    """As `_rfind_aligned`, token by token at every position (numpy, one pass per pattern token):
    work proportional to the length, whatever the content."""
    tokens = np.frombuffer(data[: end - end % 4], dtype=np.intc)  # a copy: the caller's buffer grows later
    want = array("i", pattern).tolist()
    starts = len(tokens) - len(want) + 1
    if starts < 1:
        return None
    found = np.ones(starts, dtype=bool)
    for i, token in enumerate(want):
        found &= tokens[i : i + starts] == token
    hits = np.flatnonzero(found)
    return 4 * int(hits[-1]) if len(hits) else None
