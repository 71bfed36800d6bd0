"""KV-cache memory: a pool of fixed-size blocks, reference counted, with automatic prefix caching.

Contract of `BlockPool`:
* every block is in exactly one state: used (ref_cnt > 0), or free (ref_cnt == 0, in `free_queue`);
* a free block may still hold a cached prefix (it has a hash and sits in `cached`); it is reused
  on a hit and evicted only when `allocate` needs it, least recently freed first;
* `free` takes blocks in eviction order: callers pass a request's blocks tail first, so a chain's
  tail is evicted before its head.

`KVCacheManager` maps requests to their blocks and is the only thing the scheduler talks to; it
reads of a request only what `CachedSequence` names.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class CachedSequence(Protocol):
    """What the cache manager reads of a request (the scheduler's `Request` is one)."""

    request_id: str
    num_computed_tokens: int
    block_hashes: list[bytes]  # one per full block of its tokens, chained

    @property
    def num_tokens(self) -> int: ...

    @property
    def needs_whole_prompt(self) -> bool: ...  # prompt logprobs: every position is computed


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the first entry is reused first.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free, as in vLLM)."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[Block]:
        """Take `n` free blocks (evicting any cached content they hold); each gets ref_cnt 1."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference to cached blocks found by `lookup`, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks_in_eviction_order: Iterable[Block]) -> None:
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            self.free_queue[block.block_id] = block
            if block.block_hash is None:  # holds nothing reusable: hand it out before cached ones
                self.free_queue.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Publish a computed full block under its hash (a duplicate of cached content stays private)."""
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def check_integrity(self) -> None:
        """free + used == total, no block both free and referenced, the hash index consistent."""
        free_ids = set(self.free_queue)
        assert len(free_ids) == len(self.free_queue)
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), f"block {block.block_id} misplaced"
        for h, block in self.cached.items():
            assert block.block_hash == h, f"cached index points at block {block.block_id} with another hash"


class KVCacheManager:
    """Which blocks each request holds; allocation on demand, prefix-cache lookups, freeing."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_published: dict[str, int] = {}  # how many of a request's blocks are in the cache

    def get_computed_blocks(self, req: CachedSequence) -> list[Block]:
        """The longest cached prefix of `req`, never covering its last token (its logits are needed).
        A request that wants prompt logprobs computes its whole prompt."""
        if not self.enable_caching or req.needs_whole_prompt:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, req: CachedSequence, num_new_tokens: int, computed: list[Block] = ()) -> list[int] | None:
        """Give `req` blocks for `num_new_tokens` more tokens after its computed ones (and `computed`
        cached blocks on admission). Returns the ids of blocks added to its table, or None, changing
        nothing, when the pool cannot supply them."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(blocks) - len(computed)
        if needed <= 0 and not computed:  # the common decode step: the last block has room
            return []
        reclaimed = sum(1 for b in computed if b.ref_cnt == 0)  # hits sitting in the free queue
        if needed > self.pool.num_free - reclaimed:
            return None
        self.pool.touch(computed)
        new = list(computed) + self.pool.allocate(max(needed, 0))
        blocks.extend(new)
        return [b.block_id for b in new]

    def publish_full_blocks(self, req: CachedSequence, num_tokens: int) -> None:
        """Make `req`'s full blocks among its first `num_tokens` tokens findable by later requests.

        Called when those tokens are scheduled, before they are computed: every request that
        hits them in the same step reads them after this step's cache writes (each layer writes
        all of a step's K/V before any attention), and a request is never preempted in the step
        that allocated its blocks, so a published block is always computed before it is read.
        """
        if not self.enable_caching:
            return
        done = self.num_published.get(req.request_id, 0)
        full = min(num_tokens // self.block_size, len(req.block_hashes))
        if full <= done:
            return
        blocks = self.req_blocks[req.request_id]
        for i in range(done, full):
            self.pool.cache(blocks[i], req.block_hashes[i])
        self.num_published[req.request_id] = max(done, full)

    def trim(self, req: CachedSequence, num_tokens: int) -> None:
        """Free `req`'s blocks past those its first `num_tokens` tokens fill: what a rejected run
        of proposals left beyond a block boundary (never published: only computed tokens are)."""
        blocks = self.req_blocks.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is not None and len(blocks) > keep:
            self.pool.free(reversed(blocks[keep:]))
            del blocks[keep:]

    def free(self, req: CachedSequence) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_published.pop(req.request_id, None)
        self.pool.free(reversed(blocks))

    def num_blocks_of(self, req: CachedSequence) -> int:
        return len(self.req_blocks.get(req.request_id, ()))
