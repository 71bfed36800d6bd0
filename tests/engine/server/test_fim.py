"""Fill-in-the-middle prompts (`engine.server.fim`, `prompts.fim_prompts`), built for each family on
tiny tokenizers that carry that family's special tokens, against each family's documented prompt."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, processors
from transformers import CodeLlamaTokenizer, PreTrainedTokenizerFast

from portcullis.engine.assets import DEMO_MODEL_DIR
from portcullis.engine.server import fim
from portcullis.engine.server.errors import APIError
from portcullis.engine.server.prompts import completion_prompts as _completion_prompts
from portcullis.engine.server.protocol import CompletionRequest
from tests.support.tokenizers import without_fim_tokens


def completion_prompts(req, tok):
    """As the route calls it, with the tokenizer's longest token."""
    return _completion_prompts(req, tok, max(map(len, tok.get_vocab())))


PREFIX = 'def greet(name):\n    """Say hello."""\n    '
SUFFIX = "\n    return message\n"

# Each family's prompt as its model card writes it, and the tokens its vocabulary adds.
QWEN = ("<|fim_prefix|>{p}<|fim_suffix|>{s}<|fim_middle|>",
        ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"])
STARCODER = ("<fim_prefix>{p}<fim_suffix>{s}<fim_middle>",
             ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>", "<repo_name>"])
DEEPSEEK = ("<｜fim▁begin｜>{p}<｜fim▁hole｜>{s}<｜fim▁end｜>",
            ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"])


def without_fim() -> Tokenizer:
    """The demo model's byte-level BPE tokenizer with its own FIM tokens renamed to unused ones
    (the ids stay), so that each test decides which family's markers it holds."""
    return Tokenizer.from_str(without_fim_tokens((DEMO_MODEL_DIR / "tokenizer.json").read_text()))


def byte_level(added: list[str], bos: str | None = None):
    """The demo model's byte-level BPE tokenizer with `added` as special tokens; with `bos`, it
    starts every prompt with that token (as DeepSeek-Coder's does)."""
    t = without_fim()
    t.add_special_tokens(added)
    if bos is not None:
        t.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, t.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token=bos or "<|endoftext|>", eos_token="<|endoftext|>")


def code_llama() -> CodeLlamaTokenizer:
    """transformers' CodeLlama tokenizer (SentencePiece-style BPE with byte fallback) on a tiny vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz()=:\n\"."]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "d"), ("e", "f"), ("▁d", "ef"), ("r", "e"), ("t", "u"), ("re", "tu"), ("retu", "r"),
              ("retur", "n"), ("▁", "return")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for marker in ("▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"):
        vocab[marker] = len(vocab)
    return CodeLlamaTokenizer(vocab=vocab, merges=merges)


def request(prompt, suffix=SUFFIX, **kw) -> CompletionRequest:
    return CompletionRequest(prompt=prompt, suffix=suffix, **kw)


@pytest.mark.parametrize("family, tokenizer, form", [
    ("qwen", lambda: byte_level(QWEN[1]), QWEN[0]),
    ("starcoder", lambda: byte_level(STARCODER[1]), STARCODER[0]),
    ("deepseek", lambda: byte_level(DEEPSEEK[1], bos=DEEPSEEK[1][0]), DEEPSEEK[0]),
])
def test_byte_level_families_build_their_documented_prompt(family, tokenizer, form):
    tok = tokenizer()
    template = fim.detect(tok)
    assert template is not None and template.family.name == family
    [prompt] = completion_prompts(request(PREFIX), tok)
    # The model card's string, with its markers parsed as special tokens (and BOS where the tokenizer adds it).
    assert prompt.token_ids == tok.encode(form.format(p=PREFIX, s=SUFFIX))
    assert prompt.text == PREFIX  # echo shows the client's prefix, not the scaffolding


def test_deepseek_starts_with_bos_and_qwen_does_not():
    tok = byte_level(DEEPSEEK[1], bos=DEEPSEEK[1][0])
    deepseek, qwen = fim.detect(tok), fim.detect(byte_level(QWEN[1]))
    assert deepseek.bos == (tok.convert_tokens_to_ids("<｜begin▁of▁sentence｜>"),) and deepseek.num_markers == 4
    assert qwen.bos == () and qwen.num_markers == 3


def test_end_ids_are_the_family_tokens_the_vocabulary_has():
    tok = byte_level(QWEN[1])
    template = fim.detect(tok)
    names = tok.convert_ids_to_tokens(list(template.end_ids))
    assert set(names) == {"<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>",
                          "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"}
    starcoder = byte_level(STARCODER[1])
    names = starcoder.convert_ids_to_tokens(list(fim.detect(starcoder).end_ids))
    assert "<fim_pad>" in names and "<file_sep>" in names and "<filename>" not in names  # StarCoder2 has none


def test_code_llama_follows_metas_reference():
    """Meta's `infilling_prompt_tokens`: [BOS, <PRE>] + encode(prefix) (SentencePiece's leading
    space) + [<SUF>] + encode_infilling(suffix) (no leading space) + [<MID>]."""
    tok = code_llama()
    template = fim.detect(tok)
    assert template.family.name == "codellama" and template.bos == (tok.bos_token_id,)
    [prompt] = completion_prompts(request("def f(x):", suffix="\n    return y"), tok)
    assert tok.convert_ids_to_tokens(prompt.token_ids) == [
        "<s>", "▁<PRE>", "▁def", "▁", "f", "(", "x", ")", ":",
        "▁<SUF>", "\n", "▁", "▁", "▁", "▁return", "▁", "y", "▁<MID>"]
    assert tok.convert_ids_to_tokens(list(template.end_ids)) == ["▁<EOT>", "</s>"]
    # transformers' own infilling agrees up to the suffix, to which its fast tokenizer (unlike
    # Meta's reference and its older slow tokenizer) gives a leading space.
    hf = tok("def f(x):", suffix="\n    return y")["input_ids"]
    cut = hf.index(template.suffix_id) + 1
    assert hf[:cut] == prompt.token_ids[:cut]


def test_marker_strings_in_user_text_stay_text():
    tok = byte_level(QWEN[1])
    template = fim.detect(tok)
    markers = "<|fim_prefix|><|fim_suffix|><|fim_middle|><|endoftext|>"
    [prompt] = completion_prompts(request("x = '" + markers + "'", suffix="# " + markers), tok)
    specials = {template.prefix_id, template.suffix_id, template.middle_id, *template.end_ids}
    assert [t for t in prompt.token_ids if t in specials] == [template.prefix_id, template.suffix_id, template.middle_id]
    assert tok.decode(prompt.token_ids) == f"<|fim_prefix|>x = '{markers}'<|fim_suffix|># {markers}<|fim_middle|>"


def test_every_prompt_of_a_list_gets_the_suffix_and_token_ids_are_prefixes():
    tok = byte_level(QWEN[1])
    template = fim.detect(tok)
    suffix_ids = tok.encode(SUFFIX)
    a, b = completion_prompts(request(["a = 1\n", "b = 2\n"]), tok)
    assert a.token_ids == template.build(tok.encode("a = 1\n"), suffix_ids) and a.text == "a = 1\n"
    assert b.token_ids == template.build(tok.encode("b = 2\n"), suffix_ids)
    assert a.end_ids == b.end_ids == template.end_ids
    ids = tok.encode("x = 3\n")
    [c] = completion_prompts(request(ids), tok)
    assert c.token_ids == template.build(ids, suffix_ids) and c.text is None
    [d] = completion_prompts(request(ids, echo=True), tok)
    assert d.text == "x = 3\n"  # echo decodes the prefix only
    c2, d2 = completion_prompts(request([ids, ids[:2]]), tok)
    assert c2.token_ids == c.token_ids and d2.token_ids == template.build(ids[:2], suffix_ids)


def test_truncation_drops_the_oldest_prefix_tokens_and_keeps_the_scaffolding():
    tok = byte_level(QWEN[1])
    template = fim.detect(tok)
    prefix_ids, suffix_ids = tok.encode(PREFIX), tok.encode(SUFFIX)
    k = len(suffix_ids) + 3 + 4
    [p] = completion_prompts(request(PREFIX, truncate_prompt_tokens=k), tok)
    assert len(p.token_ids) == k and p.token_ids == template.build(prefix_ids[-4:], suffix_ids)
    [whole] = completion_prompts(request(PREFIX, truncate_prompt_tokens=1000), tok)
    assert whole.token_ids == template.build(prefix_ids, suffix_ids)
    with pytest.raises(APIError) as e:
        completion_prompts(request(PREFIX, truncate_prompt_tokens=len(suffix_ids) + 2), tok)
    assert e.value.status == 400 and e.value.param == "truncate_prompt_tokens"


def test_plain_prompts_are_unchanged_and_truncated_from_the_left():
    tok = byte_level(QWEN[1])
    ids = tok.encode(PREFIX)
    for suffix in (None, ""):  # "" asks for no insertion, as a missing suffix does
        [p] = completion_prompts(request(PREFIX, suffix=suffix), tok)
        assert p.token_ids == ids and p.end_ids == ()
    [p] = completion_prompts(request(PREFIX, suffix=None, truncate_prompt_tokens=5), tok)
    assert p.token_ids == ids[-5:]


def test_a_model_without_fim_tokens_is_told_so():
    tok = PreTrainedTokenizerFast(tokenizer_object=without_fim(), eos_token="<|endoftext|>")
    assert fim.detect(tok) is None
    with pytest.raises(APIError) as e:
        completion_prompts(request("def f():"), tok)
    assert e.value.status == 400 and e.value.param == "suffix" and "FIM tokens" in e.value.message


def test_echo_with_logprobs_is_refused_with_a_suffix():
    with pytest.raises(APIError) as e:
        completion_prompts(request("x", echo=True, logprobs=1), byte_level(QWEN[1]))
    assert e.value.status == 400 and e.value.param == "echo"


def test_a_family_needs_all_three_markers():
    tok = byte_level(["<|fim_prefix|>", "<|fim_suffix|>"])  # no middle
    assert fim.detect(tok) is None
    assert fim.token_id(code_llama(), "<|fim_middle|>") is None  # not the unknown token's id
