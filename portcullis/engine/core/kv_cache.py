"""KV-cache memory: a pool of fixed-size blocks, reference counted, with automatic prefix caching.

Contract of `BlockPool`:
* every block is in exactly one state: used (ref_cnt > 0), or free (ref_cnt == 0, in `free_queue`);
* a free block may still hold a cached prefix (it has a hash and sits in `cached`); it is reused
  on a hit and evicted only when `allocate` needs it, least recently freed first;
* `free` takes blocks in eviction order: callers pass a request's blocks tail first, so a chain's
  tail is evicted before its head.

`KVCacheManager` maps requests to their blocks, one block table per KV-cache group (sliding-window
layers free what falls out of their window), and is the only thing the scheduler talks to; it
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



GroupBlocks = tuple[list[Block | None], ...]  # one list per KV-cache group, all of one length
NULL_BLOCK_ID = 0  # what a runner's table holds where a sliding group has no block: never read


class KVCacheManager:
    """Which blocks each request holds; allocation on demand, prefix-cache lookups, freeing.

    Layers of one attention kind form a KV-cache group (`sliding_windows`: one entry per group,
    None for full attention). A request has one block table per group, all of one length; a block
    id stands for the same bytes in every group (the runner gives each group its own layers of
    one set of cache tensors). A sliding group frees the blocks wholly before the window of the
    next token to compute, leaving None in their place; a prefix-cache hit needs of a sliding
    group only the blocks that window reads. A model of one kind has one group: today's path.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_windows: tuple[int | None, ...] = (None,)):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_windows = tuple(sliding_windows)
        self.frees_blocks = any(w is not None for w in self.sliding_windows)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, GroupBlocks] = {}
        self.num_published: dict[str, int] = {}  # how many of a request's blocks are in the cache

    @property
    def num_groups(self) -> int:
        return len(self.sliding_windows)

    def get_computed_blocks(self, req: CachedSequence) -> GroupBlocks:
        """The longest cached prefix of `req` every group can resume from, never covering its last
        token (its logits are needed). A request that wants prompt logprobs computes its whole prompt."""
        if not self.enable_caching or req.needs_whole_prompt:
            return tuple([] for _ in self.sliding_windows)
        hashes = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        n = len(hashes)
        while True:  # each group's longest hit up to n, until they agree (one pass with one group)
            ends = {self._longest_hit(group, hashes, n) for group in range(self.num_groups)}
            n = min(ends)
            if len(ends) == 1:
                break
        return tuple(self._hit_blocks(group, hashes, n) for group in range(self.num_groups))

    def _window_blocks(self, group: int) -> int | None:
        """How many blocks before a token's own a sliding group reads at most (None: all of them)."""
        window = self.sliding_windows[group]
        return None if window is None else -(-(window - 1) // self.block_size)

    def _longest_hit(self, group: int, hashes: list[bytes], n: int) -> int:
        """The most blocks, up to `n`, that `group` can take from the cache: a prefix of cached
        blocks, or for a sliding group the blocks its window reads before the next token."""
        need = self._window_blocks(group)
        if need is None:
            for i in range(n):
                if self.pool.lookup(_key(hashes[i], group)) is None:
                    return i
            return n
        end = n
        for i in range(n - 1, -1, -1):
            if end - i - 1 >= need:
                break
            if self.pool.lookup(_key(hashes[i], group)) is None:
                end = i
        return end

    def _hit_blocks(self, group: int, hashes: list[bytes], n: int) -> list[Block | None]:
        need = self._window_blocks(group)
        skipped = 0 if need is None else max(0, n - need)
        return [None] * skipped + [self.pool.lookup(_key(h, group)) for h in hashes[skipped:n]]

    def allocate_slots(self, req: CachedSequence, num_new_tokens: int,
                       computed: GroupBlocks = ()) -> tuple[list[int], ...] | None:
        """Give `req` blocks for `num_new_tokens` more tokens after its computed ones (and the
        `computed` cached blocks on admission). Returns the ids added to each group's table (an
        empty tuple when none were), or None, changing nothing else, when the pool cannot supply
        them. First frees the blocks its sliding groups no longer read."""
        tables = self.req_blocks.get(req.request_id)
        if tables is None:
            tables = self.req_blocks[req.request_id] = tuple([] for _ in self.sliding_windows)
        if self.frees_blocks:
            self._free_out_of_window(req, tables)
        num_hits = len(computed[0]) if computed else 0
        total = req.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(tables[0]) - num_hits
        if needed <= 0 and not num_hits:  # the common decode step: the last block has room
            return ()
        needed = max(needed, 0)
        hits = [b for group in computed for b in group if b is not None]
        reclaimed = sum(1 for b in hits if b.ref_cnt == 0)  # hits sitting in the free queue
        if needed * len(tables) > self.pool.num_free - reclaimed:
            return None
        self.pool.touch(hits)
        added = []
        for group, blocks in enumerate(tables):
            new = (computed[group] if computed else []) + self.pool.allocate(needed)
            blocks.extend(new)
            added.append([NULL_BLOCK_ID if b is None else b.block_id for b in new])
        return tuple(added)

    def _free_out_of_window(self, req: CachedSequence, tables: GroupBlocks) -> None:
        """Free the blocks of each sliding group wholly before the window of the next token to
        compute (position `num_computed_tokens`), tail first."""
        for window, blocks in zip(self.sliding_windows, tables):
            if window is None:
                continue
            i = min(len(blocks), max(0, req.num_computed_tokens - window + 1) // self.block_size)
            out_of_window = []
            while i > 0 and blocks[i - 1] is not None:
                i -= 1
                out_of_window.append(blocks[i])
                blocks[i] = None
            self.pool.free(out_of_window)

    def publish_full_blocks(self, req: CachedSequence, num_tokens: int) -> None:
        """Make `req`'s full blocks among its first `num_tokens` tokens findable by later requests.

        Called when those tokens are scheduled, before they are computed: every request that
        hits them in the same step reads them after this step's cache writes (each layer writes
        all of a step's K/V before any attention), and a request is never preempted in the step
        that allocated its blocks, so a published block is always computed before it is read.
        (A sliding group frees only blocks before its window, which were computed in earlier steps.)
        """
        if not self.enable_caching:
            return
        done = self.num_published.get(req.request_id, 0)
        full = min(num_tokens // self.block_size, len(req.block_hashes))
        if full <= done:
            return
        for group, blocks in enumerate(self.req_blocks[req.request_id]):
            for i in range(done, full):
                if blocks[i] is not None:
                    self.pool.cache(blocks[i], _key(req.block_hashes[i], group))
        self.num_published[req.request_id] = full

    def trim(self, req: CachedSequence, num_tokens: int) -> None:
        """Free `req`'s blocks past those its first `num_tokens` tokens fill: what a rejected run
        of proposals left beyond a block boundary (never published: only computed tokens are)."""
        tables = self.req_blocks.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        if tables is not None and len(tables[0]) > keep:
            for blocks in tables:
                self.pool.free(b for b in reversed(blocks[keep:]) if b is not None)
                del blocks[keep:]

    def free(self, req: CachedSequence) -> None:
        tables = self.req_blocks.pop(req.request_id, ())
        self.num_published.pop(req.request_id, None)
        for blocks in tables:
            self.pool.free(b for b in reversed(blocks) if b is not None)

    def num_blocks_of(self, req: CachedSequence) -> int:
        """Blocks `req` holds, in all groups together."""
        return sum(sum(b is not None for b in blocks) for blocks in self.req_blocks.get(req.request_id, ()))

    def max_blocks_of(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens ever holds at once, computing at most
        `max_step_tokens` a step: a sliding group holds its window and one step's tokens."""
        full = -(-num_tokens // self.block_size)
        return sum(full if w is None else min(full, -(-(w - 1 + max_step_tokens) // self.block_size) + 1)
                   for w in self.sliding_windows)

    def check_integrity(self) -> None:
        """The pool's invariants, every request's group tables of one length, and each block's
        reference count equal to the number of tables holding it."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for request_id, tables in self.req_blocks.items():
            assert len(tables) == self.num_groups and len({len(t) for t in tables}) <= 1, f"{request_id}: ragged tables"
            ids = [b.block_id for blocks in tables for b in blocks if b is not None]
            assert len(ids) == len(set(ids)), f"{request_id} holds a block twice"
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), \
                f"block {block.block_id} held by {holders.get(block.block_id, 0)} tables, ref_cnt {block.ref_cnt}"


def _key(block_hash: bytes, group: int) -> bytes:
    """A block's key in the cache: its hash, tagged with its group after the first (each group
    holds the same tokens' K/V for other layers)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")
