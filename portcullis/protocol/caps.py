"""What one request may ask for, the same to the gateway (which refuses first, before
forwarding) and to the engine (which refuses whatever reaches it): each cap keeps a single
request from stalling every other tenant: a list scanned once per generated token, words
tokenized per request, a client's code in the chat template, a grammar to compile.

The caps follow OpenAI where it has one (128 tools, 20 top_logprobs for chat), vLLM for legacy
completions' logprobs (20, where OpenAI had 5: clients moving from vLLM keep working), and
otherwise sit well above what real clients send: OpenAI allows 4 stop strings, but IDE
assistants send a dozen or so for code completion, hence 16.
"""

from __future__ import annotations

# Top alternatives per token, for `logprobs`, `top_logprobs` and `prompt_logprobs`.
MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 128  # a banned word must be one token; no token is longer
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_CHOICES = 256  # guided_choice / structured_outputs.choice
# A grammar compiles to about 260 bytes per character at worst (long alternatives: a choice list,
# or the same as an enum, regex or EBNF), in time that grows faster than its length: 16,384
# characters 0.1-0.2 s and 4.2 MB, 65,536 about 1 s and 17 MB, the red team's 256 choices x 410
# characters (105,000) 4 s and 28 MB (demo tokenizer; a synthetic 152K-token one gave the same).
# OpenAI's enums allow 15,000 characters of values: choices get just above that, each as long as
# a stop string; a JSON Schema (as JSON text), regex or grammar gets 65,536, where a schema of
# 1,400 plain properties compiles in 0.15 s to 6 MB, and the worst measured (each property a
# string with maxLength) in 1.4-3.7 s: the grammar thread serves tenants in turn, so that is
# what another tenant's compile can wait at most behind one of these.
MAX_CHOICE_CHARS = 256
MAX_CHOICES_CHARS = 16_384
MAX_GRAMMAR_CHARS = 65_536
MAX_TOOLS = 128
MAX_MESSAGES = 2048

# The chat_template_kwargs real templates read (Qwen3, DeepSeek, gpt-oss, Qwen2-VL, Llama 3),
# as short scalars. Anything else could reach the template renderer as code (`chat_template`)
# or as unbounded data (`tools`, `documents`: those have their own request fields).
CHAT_TEMPLATE_KWARGS = frozenset({
    "enable_thinking", "thinking", "reasoning_effort", "add_vision_id", "tools_in_user_message", "date_string",
})
MAX_TEMPLATE_KWARG_CHARS = 128

# Request field -> (most entries, most characters in one entry, or None).
LIST_CAPS: dict[str, tuple[int, int | None]] = {
    "stop": (MAX_STOP_STRINGS, MAX_STOP_CHARS),
    "stop_token_ids": (MAX_STOP_TOKEN_IDS, None),
    "bad_words": (MAX_BAD_WORDS, MAX_BAD_WORD_CHARS),
    "logit_bias": (MAX_LOGIT_BIAS, None),
    "allowed_token_ids": (MAX_ALLOWED_TOKEN_IDS, None),
    "guided_choice": (MAX_CHOICES, MAX_CHOICE_CHARS),
    "tools": (MAX_TOOLS, None),
    "messages": (MAX_MESSAGES, None),
}
