"""What crosses from the scheduler to the runner each step, and nothing else: plain data, so
the runner and its input batch know the plan without importing the scheduler (which alone
holds `Request` objects). A request the runner has not seen (or must rebuild after a
preemption) comes in full once, then only what changed."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from portcullis.engine.pooling import PoolingParams
from portcullis.engine.sampling_params import SamplingParams


@dataclass(slots=True)  # not frozen: built for every scheduled request, and frozen init costs ~2x
class NewRequestData:
    """A request the runner starts afresh: first admission, or resumption after a preemption."""

    request_id: str
    token_ids: list[int]  # the prompt, then any outputs it had before a preemption (a copy)
    num_prompt_tokens: int
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding, pooled after its last chunk
    eos_token_ids: tuple[int, ...]  # empty with ignore_eos
    block_ids: tuple[list[int], ...]  # per KV-cache group
    num_computed_tokens: int  # already in the cache (prefix-cache hits)
    num_tokens: int  # computed for it this step
    num_prompt_logprobs: int  # prompt positions already scored before a preemption


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only what changed since its last step."""

    request_id: str
    new_block_ids: tuple[list[int], ...]  # per KV-cache group; empty when none were added
    num_tokens: int  # computed for it this step, its proposals included
    spec_token_ids: Sequence[int] = ()  # proposed tokens to verify (speculative decoding)
    num_draft_tokens: int = 0  # proposals the runner's draft model makes for it (slots counted in num_tokens)


@dataclass
class SchedulerOutput:
    """One step's plan. The batch runs `cached` then `new`, in list order."""

    cached: list[CachedRequestData] = field(default_factory=list)
    new: list[NewRequestData] = field(default_factory=list)
    released_ids: list[str] = field(default_factory=list)  # requests whose rows the runner may drop
    grammar_ids: list[str] = field(default_factory=list)  # structured requests that sample this step
    grammar_proposals: dict[str, list[int]] = field(default_factory=dict)  # theirs, when they have some
    num_preempted: int = 0

    @property
    def request_ids(self) -> list[str]:
        return [c.request_id for c in self.cached] + [n.request_id for n in self.new]

    @property
    def num_scheduled_tokens(self) -> list[int]:
        return [c.num_tokens for c in self.cached] + [n.num_tokens for n in self.new]

    @property
    def num_scheduled(self) -> int:
        return len(self.cached) + len(self.new)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass(frozen=True)
class GrammarOutput:
    """One step's allowed tokens: row i of `bitmask` (xgrammar's packed layout) belongs to
    `request_ids[i]`, a structured request that samples this step, at its `positions[i]`-th
    sampled position (0, or with proposals 1.. for the positions after each proposal)."""

    request_ids: list[str]
    bitmask: torch.Tensor
    positions: list[int]
