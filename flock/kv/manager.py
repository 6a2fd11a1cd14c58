from flock.kv.block_pool import BlockPool
from flock.kv.hashing import ROOT_HASH, hash_block
from flock.request import Request


class KVCacheManager:
    """Gives requests KV slots: block tables over a shared pool, with automatic prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, req: Request) -> list[int]:
        """Blocks of the request's longest cached prefix; at least one token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        hits = []
        for i in range(max_blocks):
            block = self.pool.lookup(req.block_hashes[i], self._block_tokens(req, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give `req` slots for `num_new_tokens` more tokens (after any `cached` prefix blocks it takes).

        Returns False, changing nothing, when the pool cannot hold them.
        """
        computed = req.num_computed_tokens + len(cached) * self.block_size
        total_blocks = self.blocks_needed(computed + num_new_tokens)
        new_blocks = total_blocks - len(req.block_table) - len(cached)
        reviving = sum(1 for b in cached if self.pool.ref_count[b] == 0)
        if new_blocks + reviving > self.pool.num_free:
            return False
        for block in cached:
            self.pool.touch(block)
        req.block_table.extend(cached)
        req.num_computed_tokens = computed
        req.block_table.extend(self.pool.allocate(max(new_blocks, 0)))
        self._register_full_blocks(req, computed + num_new_tokens)
        return True

    def free(self, req: Request) -> None:
        self.pool.release(reversed(req.block_table))
        req.block_table = []
        req.num_registered_blocks = 0

    def _register_full_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        full = num_tokens // self.block_size
        self._extend_hashes(req, full)
        for i in range(req.num_registered_blocks, full):
            self.pool.register(req.block_table[i], req.block_hashes[i], self._block_tokens(req, i))
        req.num_registered_blocks = max(req.num_registered_blocks, full)

    def _extend_hashes(self, req: Request, num_blocks: int) -> None:
        hashes = req.block_hashes
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, self._block_tokens(req, len(hashes))))

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        return tuple(req.token_ids[i * self.block_size : (i + 1) * self.block_size])
