"""Fill-in-the-middle: the prompt a code model was trained on for `prompt` + `suffix`.

Each family's markers are special tokens of its tokenizer; `detect` finds the family from the
vocabulary, so nothing has to be configured. The prompt is built from token ids: the markers by
id, the prefix and suffix tokenized as text with special tokens split, so a file that happens
to contain `<|fim_prefix|>` stays text and cannot forge the scaffolding. All families here
are PSM (prefix, suffix, middle): the prefix comes first, right after BOS, so requests that
share a prefix share its cached KV blocks.

What `/v1/completions` does with a `suffix` (`prompts.fim_prompts`): every prompt of a list is a
prefix for the same suffix; a token-id prompt is a prefix as it stands; `echo` shows the
client's prefix, not the markers (echo with logprobs is refused: the scored prompt is not the
echoed one); `truncate_prompt_tokens` drops the prefix's oldest tokens; the family's end tokens
become stop token ids of the request (not shown, `stop_reason` their id; EOS stays EOS), except
with `ignore_eos`. A suffix of "" is no suffix. A model without FIM tokens answers 400 (`suffix`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FimFamily:
    """One family's markers and the tokens that end its middle (those its vocabulary has)."""

    name: str
    prefix: str
    suffix: str
    middle: str
    ends: tuple[str, ...]
    # CodeLlama's reference (Meta's `infilling_prompt_tokens`) encodes the prefix with
    # SentencePiece's implicit leading space and the suffix without one.
    bare_suffix: bool = False


_QWEN_MARKERS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
_STARCODER_MARKERS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
_DEEPSEEK_MARKERS = ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")

# First match wins. CodeGemma uses Qwen's marker strings (with `<|file_separator|>`).
FAMILIES: tuple[FimFamily, ...] = (
    FimFamily("qwen", *_QWEN_MARKERS, ends=(
        "<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>", "<|file_separator|>",
        *_QWEN_MARKERS)),
    FimFamily("starcoder", *_STARCODER_MARKERS, ends=(
        "<|endoftext|>", "<fim_pad>", "<file_sep>", "<repo_name>", "<filename>", *_STARCODER_MARKERS)),
    FimFamily("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", ends=("▁<EOT>", "</s>"), bare_suffix=True),
    FimFamily("deepseek", *_DEEPSEEK_MARKERS, ends=(
        "<｜end▁of▁sentence｜>", "<|EOT|>", *_DEEPSEEK_MARKERS)),
)

# Encoded before a CodeLlama suffix and cut off again, so the suffix gets no leading space
# (Meta's `encode_infilling` does the same with this character).
_ANCHOR = "☺"


@dataclass(frozen=True)
class FimTemplate:
    """A family resolved against one tokenizer: marker ids and end-of-middle ids."""

    family: FimFamily
    bos: tuple[int, ...]  # what the tokenizer puts before a plain prompt (BOS), or nothing
    prefix_id: int
    suffix_id: int
    middle_id: int
    end_ids: tuple[int, ...]

    def build(self, prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
        return [*self.bos, self.prefix_id, *prefix_ids, self.suffix_id, *suffix_ids, self.middle_id]

    @property
    def num_markers(self) -> int:
        """Tokens the scaffolding adds to prefix and suffix."""
        return len(self.bos) + 3

    def encode_prefix(self, tokenizer, text: str) -> list[int]:
        return _encode_text(tokenizer, text)

    def encode_suffix(self, tokenizer, text: str) -> list[int]:
        if not self.family.bare_suffix:
            return _encode_text(tokenizer, text)
        anchor = _encode_text(tokenizer, _ANCHOR)
        ids = _encode_text(tokenizer, _ANCHOR + text)
        # Should the anchor merge with the text, keep the leading space rather than cut a token.
        return ids[len(anchor):] if ids[: len(anchor)] == anchor else _encode_text(tokenizer, text)


def detect(tokenizer) -> FimTemplate | None:
    """The FIM template of the first family whose three markers are all in the vocabulary."""
    for family in FAMILIES:
        ids = [token_id(tokenizer, t) for t in (family.prefix, family.suffix, family.middle)]
        if None not in ids:
            ends = (token_id(tokenizer, t) for t in family.ends)
            return FimTemplate(family, _bos(tokenizer), *ids, tuple(dict.fromkeys(i for i in ends if i is not None)))
    return None


def token_id(tokenizer, token: str) -> int | None:
    """The id of `token` if the vocabulary has it (not the unknown token standing in for it)."""
    i = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(i, int) or tokenizer.convert_ids_to_tokens(i) != token:
        return None
    return i


def _bos(tokenizer) -> tuple[int, ...]:
    """BOS when the tokenizer starts plain prompts with it (CodeLlama, DeepSeek-Coder), so a
    FIM prompt starts as the model's training documents did."""
    bos = tokenizer.bos_token_id
    if bos is None or tokenizer.encode("x")[:1] != [bos] or tokenizer.encode("x", add_special_tokens=False)[:1] == [bos]:
        return ()
    return (bos,)


def _encode_text(tokenizer, text: str) -> list[int]:
    # split_special_tokens: marker strings in user text are text, never the markers themselves.
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
