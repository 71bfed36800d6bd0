"""Block pool and KV cache manager: allocation, ref counts, LRU eviction order, hash chaining, salts."""
from __future__ import annotations

import pytest

from portcullis.engine.core.kv_cache import NULL_BLOCK_ID, BlockPool, KVCacheManager
from portcullis.engine.core.request import Request, hash_block
from portcullis.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None, max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), block_size=BS, max_model_len=1000, cache_salt=salt)


def run_prefill(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit `req` like the scheduler does and mark its prompt computed; returns its block ids."""
    hits = kv.get_computed_blocks(req)
    ids = kv.allocate_slots(req, req.num_tokens - len(hits[0]) * BS, hits)
    assert ids is not None
    kv.publish_full_blocks(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    return [b.block_id for b in kv.req_blocks[req.request_id][0]]


def test_allocate_on_demand_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(10, 16)))  # 6 tokens -> 2 blocks
    run_prefill(kv, req)
    assert kv.num_blocks_of(req) == 2 and kv.pool.num_free == 6
    for token, expect_blocks in [(1, 2), (2, 2), (3, 3)]:  # tokens 7, 8 fit; the 9th opens block 3
        req.append_output_token(token)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        assert kv.num_blocks_of(req) == expect_blocks
    kv.pool.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    req = make_request("a", list(range(20)))  # 5 blocks needed
    assert kv.allocate_slots(req, 20) is None
    assert kv.pool.num_free == 2 and kv.num_blocks_of(req) == 0
    kv.pool.check_integrity()


def test_free_returns_blocks_and_ref_counts_share():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(100, 109))  # 9 tokens: two full blocks reusable
    a, b = make_request("a", prompt), make_request("b", prompt)
    blocks_a = run_prefill(kv, a)
    blocks_b = run_prefill(kv, b)
    assert blocks_b[:2] == blocks_a[:2] and blocks_b[2] != blocks_a[2]
    assert [kv.pool.blocks[i].ref_cnt for i in blocks_a[:2]] == [2, 2]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in blocks_a[:2]] == [1, 1]
    kv.free(b)
    assert kv.pool.num_free == 8
    kv.pool.check_integrity()


def test_lookup_never_covers_the_last_prompt_token():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(8))  # exactly two full blocks
    run_prefill(kv, make_request("a", prompt))
    again = make_request("b", prompt)
    assert len(kv.get_computed_blocks(again)[0]) == 1  # the second block holds the last token


def test_hash_chaining_depends_on_the_whole_prefix():
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_request("b", [9, 2, 3, 4, 5, 6, 7, 8, 9])
    assert a.block_hashes[1] != b.block_hashes[1]  # same second block, different parent
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], [5, 6, 7, 8])
    assert len(a.block_hashes[0]) == 32  # SHA-256


def test_salts_isolate_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(50, 63))
    run_prefill(kv, make_request("a", prompt, salt="tenant-a"))
    assert kv.get_computed_blocks(make_request("b", prompt, salt="tenant-b")) == ([],)
    assert kv.get_computed_blocks(make_request("c", prompt)) == ([],)
    assert len(kv.get_computed_blocks(make_request("d", prompt, salt="tenant-a"))[0]) == 3


def test_freed_blocks_evicted_lru_and_tail_first():
    pool = BlockPool(6)
    kv = KVCacheManager(6, BS)
    kv.pool = pool
    old = make_request("old", list(range(200, 209)))  # blocks: 2 hashed + 1 partial
    new = make_request("new", list(range(300, 309)))
    old_ids, new_ids = run_prefill(kv, old), run_prefill(kv, new)
    kv.free(old)
    kv.free(new)
    order = list(pool.free_queue)
    # Unhashed partial blocks first, then old's chain tail before head, then new's.
    assert order[:2] == [new_ids[2], old_ids[2]]
    assert order[2:] == [old_ids[1], old_ids[0], new_ids[1], new_ids[0]]
    # Taking three blocks evicts old's tail; old's head survives and still hits.
    filler = make_request("filler", list(range(900, 912)))
    assert kv.allocate_slots(filler, 12) is not None
    hits = kv.get_computed_blocks(make_request("again", list(range(200, 209))))
    assert [b.block_id for b in hits[0]] == [old_ids[0]]
    kv.pool.check_integrity()


def test_cache_hit_on_free_block_reclaims_it():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    prompt = list(range(40, 49))
    first = make_request("a", prompt)
    run_prefill(kv, first)
    kv.free(first)
    assert kv.pool.num_free == 3
    b = make_request("b", prompt)
    hits = kv.get_computed_blocks(b)
    assert len(hits[0]) == 2
    b.num_computed_tokens = 0
    assert kv.allocate_slots(b, 1, hits) is not None  # 2 hits reclaimed + 1 new block
    assert kv.pool.num_free == 0
    kv.pool.check_integrity()


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    prompt = list(range(9))
    req = Request("a", prompt, SamplingParams(), block_size=BS, max_model_len=100, hash_blocks=False)
    run_prefill(kv, req)
    again = Request("b", prompt, SamplingParams(), block_size=BS, max_model_len=100, hash_blocks=False)
    assert kv.get_computed_blocks(again) == ([],)


@pytest.mark.parametrize("n", [0, -1])
def test_pool_needs_blocks(n):
    with pytest.raises(ValueError):
        BlockPool(n)


# -- KV-cache groups: a full-attention group and a sliding one (window 6: it reads the 5 tokens
# before each token's own, at most 2 blocks of 4) ------------------------------------------------
HYBRID = (None, 6)


def test_a_sliding_group_frees_what_leaves_its_window():
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_windows=HYBRID)
    req = make_request("a", [1, 2, 3, 4], max_tokens=30)
    run_prefill(kv, req)
    frees = []
    for token in range(20):
        req.append_output_token(token)
        before = kv.pool.num_free
        assert kv.allocate_slots(req, 1) is not None
        frees.append(kv.pool.num_free - before)
        full, sliding = kv.req_blocks["a"]
        first = max(0, req.num_computed_tokens - 6 + 1) // BS  # the first block the new token reads
        assert sliding[:first] == [None] * first and None not in sliding[first:] and None not in full
        req.num_computed_tokens += 1
        kv.check_integrity()
    assert 1 in frees  # a block came back at a step that needed none
    assert kv.num_blocks_of(req) == 6 + 2  # 24 tokens: 6 full blocks; the last one read positions 18-23
    kv.free(req)
    assert kv.pool.num_free == 16
    kv.check_integrity()


def test_a_sliding_hit_takes_only_its_windows_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_windows=HYBRID)
    prompt = list(range(17))  # 4 full blocks can hit (the fifth holds the last token)
    run_prefill(kv, make_request("a", prompt))
    kv.free(make_request("a", prompt))
    full, sliding = kv.get_computed_blocks(make_request("b", prompt))
    assert len(full) == len(sliding) == 4 and None not in full
    assert sliding[:2] == [None, None] and None not in sliding[2:]
    full_ids, sliding_ids = kv.allocate_slots(make_request("b", prompt), 1, (full, sliding))
    assert full_ids[:4] == [b.block_id for b in full] and len(full_ids) == 5
    assert sliding_ids[:4] == [NULL_BLOCK_ID] * 2 + [b.block_id for b in sliding[2:]] and len(sliding_ids) == 5
    kv.check_integrity()


def test_a_hit_shrinks_to_where_every_group_has_its_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_windows=HYBRID)
    prompt = list(range(17))
    req = make_request("a", prompt)
    run_prefill(kv, req)
    sliding_tail = kv.req_blocks["a"][1][3]
    kv.free(req)
    kv.pool._evict(sliding_tail)  # the sliding group's fourth block is gone, the full group's stays
    full, sliding = kv.get_computed_blocks(make_request("b", prompt))
    assert len(full) == len(sliding) == 3 and sliding[0] is None and None not in sliding[1:]
