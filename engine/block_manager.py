"""BlockManager: paged KV blocks with reference counts and prefix caching by chained block hash (no torch)."""

from __future__ import annotations

from collections import OrderedDict

from .block_hash import ROOT, BlockHash, hash_block
from .request import Request


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None  # set once the block is full and its tokens are computed


class BlockManager:
    """Owns the KV blocks. A free block keeps its hash (and so its cached K/V) until it is reused;
    free blocks are handed out least-recently-freed first, which is an LRU eviction of cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}  # block key (sha256, block_hash.py) -> block id
        self.num_prefix_hits = 0  # tokens served from the prefix cache (for metrics)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_blocks)

    def _request_block_hashes(self, req: Request, num_full_blocks: int) -> list[BlockHash]:
        """The chained keys of req's first num_full_blocks blocks (each computed once per request)."""
        bs = self.block_size
        while len(req.block_hashes) < num_full_blocks:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else (req.block_hash_seed or ROOT)  # a seed: it forces MoE routes
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs]))
        return req.block_hashes[:num_full_blocks]

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Longest cached prefix of full blocks. At least one token is always left to compute, because the
        last prompt position must run through the model to produce logits."""
        if (not self.enable_prefix_caching or req.params.prompt_logprobs is not None
                or req.params.skip_reading_prefix_cache):
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in self._request_block_hashes(req, max_blocks):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make req's blocks cover num_computed (+ the cache hit) + num_new_tokens tokens. All or nothing."""
        if not computed_blocks and req.num_computed_tokens + num_new_tokens <= len(req.block_ids) * self.block_size:
            return True  # most decode steps: the last block still has room
        computed_blocks = computed_blocks or []
        num_tokens = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = -(-num_tokens // self.block_size) - len(req.block_ids) - len(computed_blocks)
        # Cache hits sitting in the free list are taken out of it, so they do not count as free.
        reclaimed = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if need > self.num_free_blocks - reclaimed:
            return False
        for b in computed_blocks:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free[b]
            block.ref_count += 1
            req.block_ids.append(b)
        if computed_blocks:
            req.num_computed_tokens += len(computed_blocks) * self.block_size
            self.num_prefix_hits += len(computed_blocks) * self.block_size
        for _ in range(max(0, need)):
            req.block_ids.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached prefix
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, req: Request) -> None:
        """Publish req's blocks that are full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose tokens are all known on the host (with a step in flight, computed may run ahead).
        # This runs for every row of every step: plain comparisons, no builtin calls, until a block filled up.
        known = req.num_computed_tokens
        if len(req.token_ids) < known:
            known = len(req.token_ids)
        num_full = known // self.block_size
        if num_full <= req.num_published_blocks:
            return  # most decode steps: no block filled up
        num_full = min(num_full, len(req.block_ids))
        if num_full <= req.num_published_blocks:
            return
        hashes = self._request_block_hashes(req, num_full)
        for i in range(req.num_published_blocks, num_full):
            block = self.blocks[req.block_ids[i]]
            if block.block_hash is None:
                block.block_hash = hashes[i]
                self.cached.setdefault(hashes[i], block.block_id)
        req.num_published_blocks = num_full

    def free_request(self, req: Request) -> None:
        # Tail blocks are freed first so they are evicted before the (more shareable) prefix blocks.
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        req.block_ids = []
        req.num_published_blocks = 0

    def reset_prefix_cache(self) -> None:
        for block_id in self.free:
            self.blocks[block_id].block_hash = None
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].ref_count > 0}
