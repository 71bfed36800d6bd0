"""From engine outputs to what a caller reads, the same for `LLM` and the server: a request's `n`
samples as engine requests (`fan_out`, one seed rule), and each sample's text, finish reason and
logprobs as its tokens arrive (`SampleOutput`). Stop strings live here, not in the engine: a
sample that meets one is finished here and must be aborted in the engine (`OutputProcessor`
says which). As in vLLM, the text of a stop token is left out unless include_stop_str_in_output.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from portcullis.engine.frontend.detokenizer import (
    CONTEXT_TOKENS,
    IncrementalDetokenizer,
    StopStrings,
    decode_after,
)
from portcullis.engine.outputs import RequestMetrics, StepOutput
from portcullis.engine.sampling_params import SamplingParams


def fan_out(request_id: str, params: SamplingParams, first_index: int = 0) -> list[tuple[str, SamplingParams]]:
    """The engine requests of one prompt's `params.n` samples, `<id>-<first_index + i>`, each
    with its own seed (`SamplingParams.for_sample`)."""
    return [(f"{request_id}-{first_index + i}", params.for_sample(i)) for i in range(params.n)]


@dataclass
class Delta:
    """New text for one sample; `finish_reason` is set on the sample's last delta only."""

    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprobs of the tokens since the last delta


class SampleOutput:
    """One sample's output as its engine request advances. With `incremental`, text is decoded
    token by token (streaming, or stop strings to match); otherwise once, at the end."""

    def __init__(self, index: int, request_id: str, params: SamplingParams, tokenizer,
                 stops: StopStrings | None = None, incremental: bool = True, prompt_token_ids: Sequence[int] = ()):
        self.index = index
        self.request_id = request_id
        self.params = params
        self.tokenizer = tokenizer
        self.context = list(prompt_token_ids[-CONTEXT_TOKENS:])  # what the output's text is decoded after
        stops = stops if stops is not None else StopStrings(params.stop)
        self.detok = None
        if tokenizer is not None and (incremental or stops):
            self.detok = IncrementalDetokenizer(
                tokenizer, skip_special_tokens=params.skip_special_tokens, stop=stops,
                include_stop_str_in_output=params.include_stop_str_in_output, context=self.context,
            )
        self._text = ""  # the text when not decoded incrementally
        self.token_ids: list[int] = []
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list = []  # TokenLogprobs per output token, when asked for
        self.prompt_logprobs: list | None = None
        self.metrics: RequestMetrics | None = None
        self.accepted_prediction_tokens = 0  # with Predicted Outputs
        self._unsent_logprobs: list = []

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else self._text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def advance(self, out: StepOutput) -> Delta:
        self.completion_tokens = out.num_output_tokens
        self.cached_tokens = out.num_cached_tokens
        self.metrics = out.metrics or self.metrics
        if out.num_accepted_prediction_tokens is not None:
            self.accepted_prediction_tokens = out.num_accepted_prediction_tokens
        ids = out.new_token_ids
        self.token_ids += ids
        self._take_logprobs(out)
        # The engine says "stop" only for a stop token (EOS or stop_token_ids).
        by_token = out.finish_reason == "stop" and bool(ids)
        shown = ids[:-1] if by_token and not self.params.include_stop_str_in_output else ids
        text = self._decode(shown, out)
        if self.detok is not None and self.detok.stopped:
            self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
        elif out.finished:
            self.finish_reason = out.finish_reason
            if by_token and ids[-1] in self.params.stop_token_ids:
                self.stop_reason = ids[-1]
        delta = Delta(self.index, text, self.finish_reason, self.stop_reason)
        if text or self.finish_reason is not None:  # logprobs travel with the text they belong to
            delta.logprobs, self._unsent_logprobs = self._unsent_logprobs, []
        return delta

    def _decode(self, shown: list[int], out: StepOutput) -> str:
        if self.detok is not None:
            return self.detok.update(shown, final=out.finished, match_stop=out.num_output_tokens > self.params.min_tokens)
        if not out.finished or self.tokenizer is None:
            return ""
        cut = len(self.token_ids) - (len(out.new_token_ids) - len(shown))
        self._text = decode_after(self.tokenizer, self.context, self.token_ids[:cut], self.params.skip_special_tokens)
        return self._text

    def _take_logprobs(self, out: StepOutput) -> None:
        if out.logprobs:
            self.logprobs += out.logprobs
            self._unsent_logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs


class OutputProcessor:
    """The samples in flight of one caller, by engine request id."""

    def __init__(self, samples: list[SampleOutput] = ()):
        self.samples = {s.request_id: s for s in samples}
        self.num_unfinished = len(self.samples)

    def process(self, out: StepOutput) -> tuple[Delta | None, bool]:
        """Apply one engine output: the delta to show (None: nothing new, or the engine's echo of
        an abort sent after a stop string) and whether the engine must now abort that request
        (its sample met a stop string the engine knows nothing of)."""
        sample = self.samples[out.request_id]
        if sample.finished:
            sample.metrics = out.metrics or sample.metrics
            return None, False
        delta = sample.advance(out)
        if sample.finished:
            self.num_unfinished -= 1
        if not delta.text and delta.finish_reason is None:
            return None, False
        return delta, sample.finished and not out.finished

    def unfinished_ids(self) -> list[str]:
        return [rid for rid, s in self.samples.items() if not s.finished]
