"""A request's state as it moves through the engine. The scheduler owns it: nothing else reads or
writes a `Request` (the runner, the sampler and the front-ends get plain data)."""
from __future__ import annotations

import enum
import hashlib
import time
from array import array

from portcullis.engine.pooling import PoolingParams
from portcullis.engine.sampling_params import SamplingParams

_ROOT_HASH = bytes(32)


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """Content hash of one full block, chained from its parent's (SHA-256; never Python's hash())."""
    h = hashlib.sha256(parent or _ROOT_HASH)
    h.update(array("i", token_ids).tobytes())
    if extra:
        h.update(len(extra).to_bytes(4, "little"))
        h.update(extra)
    return h.digest()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        # By value: asked once per output token, and comparing enum members costs microseconds.
        return self._value_ in _FINISH_REASONS


_FINISH_REASONS = frozenset({"stop", "length", "abort"})


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        *,
        block_size: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        cache_salt: str | None = None,
        hash_blocks: bool = True,
        arrival_time: float | None = None,
        structured: bool = False,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.all_token_ids = list(prompt_token_ids)  # prompt followed by outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first admission; -1 until admitted
        self.status = RequestStatus.WAITING
        self.pooling = isinstance(params, PoolingParams)  # an embedding: ends when its prompt is computed
        self.eos_token_ids = () if self.pooling or params.ignore_eos else eos_token_ids
        # Looked up after every token: a set, so a long stop_token_ids list costs nothing per step.
        self._stop_ids = frozenset(self.eos_token_ids) | frozenset(() if self.pooling else params.stop_token_ids)
        self.max_tokens = 0 if self.pooling else max_model_len - self.num_prompt_tokens
        if not self.pooling and params.max_tokens is not None:
            self.max_tokens = min(self.max_tokens, params.max_tokens)
        self.block_size = block_size
        self.salt = cache_salt.encode() if cache_salt else b""
        self.hash_blocks = hash_blocks
        self.block_hashes: list[bytes] = []
        self._hash_new_full_blocks()
        self.structured = structured  # its output follows a grammar (see StructuredOutputManager)
        self.priority = priority  # lower runs first under the priority scheduling policy
        self.prediction: list[int] | None = None  # the client's predicted output (Predicted Outputs)
        self.num_accepted_prediction_tokens = 0
        self.spec_window = 0  # proposals it may make next, n-gram or draft (see Scheduler._propose)
        self.spec_pause = 0  # steps it proposes nothing, after its single proposals kept failing
        self.spec_backoff = 0  # the next such pause's length (doubles, reset by an accepted run)
        self.packed_token_ids = bytearray()  # all_token_ids as 4-byte ints for the n-gram lookup, kept up by it
        self.prompt_logprobs: list = []  # entry k: logprobs of prompt token k + 1
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_whole_prompt(self) -> bool:
        """Prompt logprobs score every prompt position, and mean or CLS pooling reads every
        position's hidden state, so no prefix-cache hit may skip one."""
        return self.pooling or self.params.prompt_logprobs is not None

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            self._hash_new_full_blocks()

    def _hash_new_full_blocks(self) -> None:
        if not self.hash_blocks:
            return
        bs = self.block_size
        for i in range(len(self.block_hashes), len(self.all_token_ids) // bs):
            parent = self.block_hashes[-1] if self.block_hashes else None
            extra = self.salt if i == 0 else b""  # chaining carries the salt into every later block
            self.block_hashes.append(hash_block(parent, self.all_token_ids[i * bs : (i + 1) * bs], extra))

    def check_stop(self, grammar_done: bool = False) -> RequestStatus | None:
        """After a new token: the finished status it causes, if any (`grammar_done`: the token
        completed the request's grammar)."""
        last = self.all_token_ids[-1]
        if grammar_done:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens > self.params.min_tokens or self.num_output_tokens == self.max_tokens:
            if last in self._stop_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
