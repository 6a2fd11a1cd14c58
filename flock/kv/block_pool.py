from collections import OrderedDict

TAILS_PER_PARENT = 8  # donors kept per parent block (the newest): any one gives the common start of a group


class BlockPool:
    """Physical KV blocks: reference counts, an LRU queue of free blocks, and the prefix-cache index.

    A free block may still hold a cached prefix (its hash stays in `cached`); it is evicted only when the
    allocator takes it from the head of the LRU queue. Freed blocks go to the tail.
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

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._evict(block)
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

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

    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        block = self.cached.get(block_hash)
        if block is None or self.block_tokens[block] != tokens:  # collision guard
            return None
        return block

    def register(self, block: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """Record a full, computed block in the prefix cache (the first copy of a hash wins)."""
        if self.block_hash[block] is not None or block_hash in self.cached:
            return
        self.block_hash[block] = block_hash
        self.block_tokens[block] = tokens
        self.cached[block_hash] = block

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
        for block in {*self.cached.values(), *self.tail_parent}:
            self._evict(block)
