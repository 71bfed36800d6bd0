"""The runner's own request state, built from the scheduler's plain output only: rows and block
tables, what each step computes and samples, and a resumed request rebuilt exactly."""
from __future__ import annotations

import torch

from portcullis.engine.core.output import CachedRequestData, NewRequestData, SchedulerOutput
from portcullis.engine.sampling_params import SamplingParams
from portcullis.engine.worker.input_batch import InputBatch
from portcullis.engine.worker.sampler import seeded_uniform

BS = 4


def new(rid: str, tokens: list[int], num_prompt: int, blocks: list[int], computed: int = 0, **params) -> NewRequestData:
    """A new request of a one-group model (`blocks`: its one block table)."""
    return NewRequestData(rid, list(tokens), num_prompt, SamplingParams(**params), (2,), (blocks,), computed,
                          len(tokens) - computed, 0)


def test_new_then_cached_requests_fill_rows_and_block_tables():
    batch = InputBatch(max_num_seqs=4, max_blocks_per_seq=8, block_size=BS, device=torch.device("cpu"))
    scheduled = batch.update(SchedulerOutput(new=[new("a", [5, 6, 7, 8, 9], 5, [3, 1]), new("b", [4, 4], 2, [0])]))
    step = batch.prepare(scheduled)
    assert step.input_ids.tolist() == [5, 6, 7, 8, 9, 4, 4]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert step.meta.slot_mapping.tolist() == [12, 13, 14, 15, 4, 0, 1]  # block 3 then block 1; block 0
    assert step.sample_idx == [0, 1]
    batch.advance(scheduled, [[11], [12]])
    # Next step: "a" decodes its sampled token into its second block; "b" finished and is released.
    scheduled = batch.update(SchedulerOutput(cached=[CachedRequestData("a", ([],), 1)], released_ids=["b"]))
    step = batch.prepare(scheduled)
    assert step.input_ids.tolist() == [11] and step.positions.tolist() == [5]
    assert step.meta.slot_mapping.tolist() == [1 * BS + 1]  # position 5: block 1, offset 1
    assert "b" not in batch.requests and len(batch.free_rows) == 3


def test_a_resumed_request_samples_as_if_never_preempted():
    # Preempted after three outputs, resumed with its prompt and outputs and a prefix-cache hit.
    tokens = [1, 2, 3, 4, 5, 6, 7, 30, 31, 31]
    batch = InputBatch(max_num_seqs=2, max_blocks_per_seq=8, block_size=BS, device=torch.device("cpu"))
    scheduled = batch.update(SchedulerOutput(new=[new("r", tokens, 7, [6, 2, 5], computed=4, seed=9,
                                                     temperature=1.0, frequency_penalty=0.5)]))
    step = batch.prepare(scheduled)
    assert step.input_ids.tolist() == tokens[4:] and step.positions.tolist() == list(range(4, 10))
    args = batch.sampling_args([scheduled[0][0]], None, vocab=50)
    assert args.num_outputs == [3]  # the seeded draw index continues at 3
    assert list(args.output_token_ids[0]) == [30, 31, 31]
    assert args.prompt_ids[0].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert args.eos_token_ids == [(2,)]


def test_seeded_draws_depend_on_seed_and_index_only():
    draws = [seeded_uniform(7, k) for k in range(2000)]
    assert draws == [seeded_uniform(7, k) for k in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert draws[:50] != [seeded_uniform(8, k) for k in range(50)]
    # Roughly uniform: each tenth of [0, 1) within 5 standard errors of 200 draws.
    counts = torch.histc(torch.tensor(draws), bins=10, min=0.0, max=1.0)
    assert bool(((counts - 200).abs() < 5 * (2000 * 0.1 * 0.9) ** 0.5).all())
