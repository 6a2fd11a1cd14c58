import numpy as np
import xxhash

ROOT_HASH = 0


def root_hash(salt: str | None, adapter: str | None = None) -> int:
    """The parent of a request's first block: for a salted request (vLLM's cache_salt) or one of a LoRA adapter,
    the hash of its salt and adapter name, so that none of its blocks' hashes equals another salt's or adapter's."""
    if salt is None and adapter is None:
        return ROOT_HASH
    return xxhash.xxh3_64_intdigest(f"cache_salt\0{salt}\0lora\0{adapter}".encode())


def hash_block(parent: int, tokens) -> int:
    """Chained block hash: h_i = H(h_{i-1}, tokens_i), so equal hashes mean equal whole prefixes."""
    h = xxhash.xxh3_64(parent.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.intdigest()


def chained_hashes(tokens, block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of `tokens`."""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes
