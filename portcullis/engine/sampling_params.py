"""Per-request generation settings, named and defaulted as vLLM's `SamplingParams`."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from portcullis.engine.errors import RequestError
from portcullis.protocol.caps import MAX_LOGPROBS

_GREEDY_EPS = 1e-5


# The fields of a model's generation_config.json that default a request's sampling, as with
# vLLM's `--generation-config auto` (the server) and `LLM(generation_config="auto")`.
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# transformers' own defaults for those fields: vLLM reads the file through
# GenerationConfig.to_diff_dict(), which drops a value equal to them (a file's "top_k": 50
# leaves top-k off), and so does this, so a model samples here as under vLLM.
HF_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def generation_config_defaults(choice: str, model_path: Path) -> dict:
    """Those fields, where the file sets them: `choice` "auto" reads the model's folder (no
    file there: no defaults), "vllm" reads nothing, anything else is a folder that must hold
    one (FileNotFoundError). Unchecked: the caller validates them as its own settings."""
    if choice == "vllm":
        return {}
    file = (model_path if choice == "auto" else Path(choice)) / "generation_config.json"
    if not file.is_file():
        if choice == "auto":
            return {}
        raise FileNotFoundError(f"generation config {choice!r}: no generation_config.json there")
    data = json.loads(file.read_text())
    return {key: data[key] for key in GENERATION_CONFIG_FIELDS
            if data.get(key) is not None and data[key] != HF_GENERATION_DEFAULTS.get(key)}


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of the `index`-th of n samples, so that seeded samples differ from one another
    and every front-end (`LLM`, the server) draws the same n texts for one seed. Wraps at
    2**64, the width the sampler's generator takes."""
    return None if seed is None else (seed + index) % 2**64


@dataclass
class StructuredOutputsParams:
    """Constrain the output to one of: a JSON Schema, any JSON object, a regex, a choice of
    strings, or an EBNF grammar (xgrammar's dialect), as vLLM's `structured_outputs`."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise RequestError(f"give exactly one of json, json_object, regex, choice, grammar (got {given or 'none'})")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise RequestError("choice must be a non-empty list of strings", "choice")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-N alternatives per output token (0: the sampled one only)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._check_ranges()
        self._check_lengths()
        self._check_logprobs()
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    def _check_ranges(self) -> None:
        checks = [
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}"),
            ("temperature", self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            ("top_p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= -1, f"top_k must be -1, 0 (no limit) or positive, got {self.top_k}"),
            ("min_p", 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            ("repetition_penalty", self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise RequestError(message, param)
        for token, bias in (self.logit_bias or {}).items():
            if not -100 <= float(bias) <= 100:
                raise RequestError(f"logit_bias for token {token} must be in [-100, 100], got {bias}", "logit_bias")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise RequestError("allowed_token_ids must not be empty", "allowed_token_ids")

    def _check_lengths(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0:
            raise RequestError(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                               "min_tokens")

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise RequestError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of the `index`-th of `n` parallel samples: one sample each, and a
        distinct seed (`sample_seed`) so that seeded samples differ from one another. Only the
        first scores the prompt (`prompt_logprobs`): the samples share one prompt, and the others
        then take its KV blocks from the prefix cache rather than each computing the whole prompt
        again (n samples re-scoring one prompt cost n prefills, paid for as one). Shared or
        shallow-copied, not validated again: the engine never changes a request's params."""
        if self.n == 1 and self.seed is None:
            return self
        out = copy.copy(self)
        out.n, out.seed = 1, sample_seed(self.seed, index)
        if index > 0:
            out.prompt_logprobs = None
        return out
