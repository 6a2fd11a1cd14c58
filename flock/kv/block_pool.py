from collections import OrderedDict
from collections.abc import Callable

TAILS_PER_PARENT = 8  # donors kept per parent block (the newest): any one gives the common start of a group


class BlockPool:
    """Physical KV blocks: reference counts, an LRU queue of free blocks, and the prefix-cache index.

    A free block may still hold a cached prefix (its hash stays in `cached`); it is evicted only when the
    allocator takes it. Freed blocks go to the tail; the allocator takes from the head, but passes over blocks
    that waiting requests will read (`want`) while others are free, and of those evicts first the ones whose
    reader waits furthest back in the queue.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        # blocks whose first tokens another request may copy (the KV of a prefix that ends inside a block):
        # parent block hash -> {block: its computed tokens}, full and partial blocks alike
        self.tails: dict[int, OrderedDict[int, tuple[int, ...]]] = {}
        self.tail_parent: dict[int, int] = {}  # block -> the parent hash it is listed under
        self._wanted_by: Callable[[], dict[int, int]] | None = None
        self._wanted: dict[int, int] | None = None  # its result, made when an allocation first needs it
        self._kept: list[int] | None = None  # when every free block is wanted: them, the next to go last

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def want(self, wanted_by: Callable[[], dict[int, int]] | None) -> None:
        """`wanted_by()`: hashes of cached blocks that waiting requests will read -> the place in the queue of the
        first such request. Called at most once until the next `want`, and only if an allocation would evict a
        cached block."""
        self._wanted_by, self._wanted, self._kept = wanted_by, None, None

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free)} free")
        blocks, left = [], len(self.free) if self._kept is None else 0
        while len(blocks) < n and left:
            block = next(iter(self.free))
            left -= 1
            h = self.block_hash[block]
            if h is not None and h in self._wanted_now():
                self.free.move_to_end(block)  # kept for now
            else:
                del self.free[block]
                blocks.append(block)
        if len(blocks) < n:  # every free block is wanted: those read last go first
            if self._kept is None:
                wanted = self._wanted_now()
                # by place, and within one the least recently freed last: taken first from the end
                self._kept = sorted(reversed(self.free), key=lambda b: wanted[self.block_hash[b]])
            while len(blocks) < n:
                block = self._kept.pop()
                if block in self.free:  # not taken back since
                    del self.free[block]
                    blocks.append(block)
        for block in blocks:
            self._evict(block)
            self.ref_count[block] = 1
        return blocks

    def _wanted_now(self) -> dict[int, int]:
        if self._wanted is None:
            self._wanted = self._wanted_by() if self._wanted_by else {}
        return self._wanted

    def touch(self, block: int) -> None:
        """Take a reference on a cached block (a prefix-cache hit)."""
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each block; pass them tail-first so prefix blocks are evicted last."""
        for block in blocks:
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} released twice"
            if self.ref_count[block] == 0:
                self.free[block] = None
                self._kept = None

    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        block = self.cached.get(block_hash)
        if block is None or self.block_tokens[block] != tokens:  # collision guard
            return None
        return block

    def register(self, block: int, block_hash: int, tokens: tuple[int, ...]) -> bool:
        """Record a full, computed block in the prefix cache (the first copy of a hash wins: False for others)."""
        if self.block_hash[block] is not None or block_hash in self.cached:
            return False
        self.block_hash[block] = block_hash
        self.block_tokens[block] = tokens
        self.cached[block_hash] = block
        return True

    def set_tail(self, block: int, parent: int, tokens: tuple[int, ...]) -> None:
        """List `block`, whose first len(tokens) tokens (after the prefix hashed as `parent`) have KV, as a donor."""
        self.drop_tail(block)
        donors = self.tails.setdefault(parent, OrderedDict())
        donors[block] = tokens
        self.tail_parent[block] = parent
        if len(donors) > TAILS_PER_PARENT:
            self.drop_tail(next(iter(donors)))

    def best_tail(self, parent: int, tokens: tuple[int, ...]) -> tuple[int | None, int]:
        """The listed block after `parent` whose tokens begin with the longest start of `tokens`, and that
        length (None, 0 when no block shares a first token)."""
        best, length = None, 0
        for block, have in self.tails.get(parent, {}).items():
            n = 0
            for a, b in zip(have, tokens):
                if a != b:
                    break
                n += 1
            if n > length:
                best, length = block, n
        return best, length

    def drop_tail(self, block: int) -> None:
        parent = self.tail_parent.pop(block, None)
        if parent is not None:
            donors = self.tails[parent]
            del donors[block]
            if not donors:
                del self.tails[parent]

    def _evict(self, block: int) -> None:
        self.drop_tail(block)
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None
            self.block_tokens[block] = None

    def reset_cache(self) -> None:
        self._kept = None
        for block in {*self.cached.values(), *self.tail_parent}:
            self._evict(block)
