from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

from flock.kv.block_pool import BlockPool
from flock.kv.disk_store import DiskKVStore

if TYPE_CHECKING:  # requests are only read here
    from flock.request import Request


class CachedPrefix(list):
    """A request's longest cached prefix: the full blocks it shares (the list), the full blocks after them that
    the disk tier holds (`disk`: their hashes, read into new blocks of its own), and where the prefix ends inside
    the next block, the cached block holding those `tail_tokens` first tokens (`tail_block`): their KV is copied
    into the request's own block instead of computed (what a token-level radix cache shares)."""

    tail_block: int | None = None
    tail_tokens: int = 0

    def __init__(self, *blocks):
        super().__init__(*blocks)
        self.disk: list[int] = []


class KVCacheManager:
    """Gives requests KV slots: block tables over a shared pool, with automatic prefix caching. It owns each
    request's block table and reads, never writes, the request itself."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 disk: DiskKVStore | None = None):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.disk = disk if enable_prefix_caching else None
        # blocks of the step being planned: (own block, KV bytes) read from disk before it runs, in order; and
        # per request, (own block, hash, tokens) of the full blocks it computes, for the disk once it has run
        self.loads: list[tuple[int, np.ndarray]] = []
        self.saves: dict[Request, list[tuple[int, int, tuple[int, ...]]]] = {}
        self.tables: dict[Request, list[int]] = {}
        self.num_registered: dict[Request, int] = {}  # leading blocks of a table already in the prefix cache
        # (source block, own block, tokens): a cached block start to copy before the step being planned runs
        self.copies: dict[Request, tuple[int, int, int]] = {}
        # tails of the step being planned: listed once it has run (their KV does not exist before)
        self.pending_tails: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (parent hash, tokens)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, req: Request) -> list[int]:
        return self.tables.get(req, [])

    def num_blocks(self, req: Request) -> int:
        return len(self.tables.get(req, ()))

    def prefix_tokens(self, cached: CachedPrefix) -> int:
        """Tokens a cached prefix covers."""
        return (len(cached) + len(cached.disk)) * self.block_size + cached.tail_tokens

    def cached_prefix(self, req: Request) -> CachedPrefix:
        """The request's longest cached prefix, to the token; at least one token is always left to compute."""
        hits = CachedPrefix()
        if not self.enable_prefix_caching or not req.reads_prefix_cache:
            return hits
        hashes = self._lookup_hashes(req)
        for i in range(len(hashes)):
            block = self.pool.lookup(hashes[i], self._block_tokens(req, i))
            if block is None:
                break
            hits.append(block)
        if self._on_disk(req):
            hits.disk = list(itertools.takewhile(self.disk.__contains__, hashes[len(hits) :]))
        i = len(hits) + len(hits.disk)
        parent = hashes[i - 1] if i else req.root_hash
        want = tuple(req.cache_ids(i * self.block_size, min((i + 1) * self.block_size, req.num_tokens - 1)))
        hits.tail_block, hits.tail_tokens = self.pool.best_tail(parent, want)
        return hits

    def allocate(self, req: Request, num_new_tokens: int, cached: CachedPrefix | None = None) -> bool:
        """Give `req` slots for `num_new_tokens` more tokens after its computed ones (and after any `cached`
        prefix blocks it takes: the scheduler then counts them as computed).

        Returns False, changing nothing, when the pool cannot hold them.
        """
        if cached is None:  # a running request's next tokens (each decode step's): its table grows
            return self._extend(req, num_new_tokens)
        computed = req.num_computed_tokens + self.prefix_tokens(cached)
        table = self.tables.get(req, [])
        new_blocks = self.blocks_needed(computed + num_new_tokens) - len(table) - len(cached)
        reviving = sum(1 for b in cached if self.pool.ref_count[b] == 0)
        if new_blocks + reviving > self.pool.num_free:
            return False
        read = self._read_disk(req, len(table) + len(cached), cached.disk)
        if len(read) < len(cached.disk):  # a block gone from disk: the prefix ends before it (the caller's
            del cached.disk[len(read) :]  # count follows), and the step computes from there
            cached.tail_block, cached.tail_tokens = None, 0
            computed = req.num_computed_tokens + self.prefix_tokens(cached)
            new_blocks = self.blocks_needed(computed + num_new_tokens) - len(table) - len(cached)
        for block in cached:
            self.pool.touch(block)
        table.extend(cached)
        first_read = len(table)
        table.extend(self.pool.allocate(max(new_blocks, 0)))
        self.tables[req] = table
        for k, (block_hash, tokens, data) in enumerate(read):
            self.pool.register(table[first_read + k], block_hash, tokens)
            self.loads.append((table[first_read + k], data))
        if cached.tail_tokens:  # the source may be taken by a later allocation: the copy runs first
            self.copies[req] = (cached.tail_block, table[(computed - 1) // self.block_size], cached.tail_tokens)
        # a draft's KV is the request's only once verified: blocks are listed up to its tokens
        self._register_blocks(req, computed, min(computed + num_new_tokens, req.num_tokens))
        return True

    def _extend(self, req: Request, num_new_tokens: int) -> bool:
        table = self.tables.get(req, [])
        computed = req.num_computed_tokens
        new_blocks = self.blocks_needed(computed + num_new_tokens) - len(table)
        if new_blocks > self.pool.num_free:
            return False
        if new_blocks > 0:
            table.extend(self.pool.allocate(new_blocks))
        self.tables[req] = table
        self._register_blocks(req, computed, min(computed + num_new_tokens, req.num_tokens))
        return True

    def keep_for(self, waiting: list[Request]) -> None:
        """Cached blocks that these waiting requests (in queue order) would read are evicted after every other
        free block, those of the requests furthest back first."""
        def wanted() -> dict[int, int]:
            places: dict[int, int] = {}
            for place in range(len(waiting) - 1, -1, -1):  # the first request's place wins
                req = waiting[place]
                if req.reads_prefix_cache:
                    # the blocks a lookup reaches: up to the first one not cached
                    reached = itertools.takewhile(self.pool.cached.__contains__, self._lookup_hashes(req))
                    places.update(dict.fromkeys(reached, place))
            return places

        self.pool.want(wanted if self.enable_prefix_caching and waiting else None)

    def take_copy(self, req: Request) -> tuple[int, int, int] | None:
        """The block start `req` copies in the step being planned (once: the step then owns it)."""
        return self.copies.pop(req, None)

    def take_loads(self) -> list[tuple[int, np.ndarray]]:
        """The blocks read from disk for the step being planned, to fill before it runs (once)."""
        loads, self.loads = self.loads, []
        return loads

    def take_saves(self, req: Request) -> list[tuple[int, int, tuple[int, ...]]]:
        """The full blocks `req` computes in the step being planned, for the disk once it has run (once)."""
        return self.saves.pop(req, [])

    def save(self, blocks: list[tuple[int, tuple[int, ...], np.ndarray]]) -> None:
        """Hand computed blocks, (hash, tokens, KV bytes), to the disk tier."""
        for block_hash, tokens, data in blocks:
            self.disk.write(block_hash, tokens, data)

    def end_step(self) -> None:
        """The planned step has run: the blocks it wrote become tails others may copy."""
        for block, (parent, tokens) in self.pending_tails.items():
            self.pool.set_tail(block, parent, tokens)
        self.pending_tails.clear()

    def free(self, req: Request) -> None:
        table = self.tables.pop(req, [])
        for block in table:  # not written by a step it will not run in
            self.pending_tails.pop(block, None)
        self.pool.release(reversed(table))
        self.num_registered.pop(req, None)
        self.copies.pop(req, None)
        self.saves.pop(req, None)

    def _register_blocks(self, req: Request, computed: int, num_tokens: int) -> None:
        """Blocks that hold KV once this step has run (tokens [computed, num_tokens) are its new ones): full
        ones into the prefix cache, and those it writes (a partial last one too) as tails others may copy."""
        if not self.enable_prefix_caching:
            return
        full = num_tokens // self.block_size
        hashes, table = req.block_hashes(self.block_size, full), self.tables[req]
        registered = self.num_registered.get(req, 0)
        saving = self._on_disk(req)
        for i in range(registered, full):
            tokens = self._block_tokens(req, i)
            if self.pool.register(table[i], hashes[i], tokens) and saving and hashes[i] not in self.disk:
                self.saves.setdefault(req, []).append((table[i], hashes[i], tokens))
        self.num_registered[req] = max(registered, full)
        for i in range(computed // self.block_size, self.blocks_needed(num_tokens)):
            tokens = tuple(req.cache_ids(i * self.block_size, min((i + 1) * self.block_size, num_tokens)))
            self.pending_tails[table[i]] = (hashes[i - 1] if i else req.root_hash, tokens)

    def _on_disk(self, req: Request) -> bool:
        """Whether the disk tier keeps `req`'s blocks: not a LoRA adapter's (its name may mean other weights in
        another run)."""
        return self.disk is not None and req.params.lora_request is None

    def _read_disk(self, req: Request, first: int, hashes: list[int]) -> list[tuple[int, tuple[int, ...], np.ndarray]]:
        """(hash, tokens, KV bytes) of the blocks `first`, `first` + 1, ... of `req` the disk holds, up to the first
        it no longer does."""
        read = []
        for k, block_hash in enumerate(hashes):
            tokens = self._block_tokens(req, first + k)
            data = self.disk.read(block_hash, tokens)
            if data is None:
                break
            read.append((block_hash, tokens, data))
        return read

    def _lookup_hashes(self, req: Request) -> list[int]:
        """Hashes of the full blocks a prefix lookup may hit: at least one token is always left to compute."""
        n = (req.num_tokens - 1) // self.block_size
        return req.block_hashes(self.block_size, n)[:n]  # the request's list may hold more

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        return tuple(req.cache_ids(i * self.block_size, (i + 1) * self.block_size))
