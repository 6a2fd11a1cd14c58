from dataclasses import dataclass

import numpy as np
import torch

from flock.kv import fp8


@dataclass
class StepLayout:
    """Where each request's tokens sit in a step and in the paged cache (built once per step)."""

    query_start: np.ndarray  # [R + 1] offsets of each request's new tokens in the flat token batch
    seq_lens: np.ndarray  # [R] tokens in context after this step (cached + new)
    block_tables: list[np.ndarray]  # per request, physical block ids
    block_size: int
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    sampled: np.ndarray | None = None  # requests whose last new token the step samples (None: not said)
    sample_counts: np.ndarray | None = None  # of those, how many last new tokens each samples (None: one)
    # [T] the last position each new token attends to (Gemma 3's image tokens: their image's last; any other
    # token: its own), its window still starting from its own position; None: causal order
    attend_ends: np.ndarray | None = None

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start)

    def context_slots(self, i: int) -> np.ndarray:
        """Cache slots of request i's whole context, in position order."""
        n = int(self.seq_lens[i])
        blocks = self.block_tables[i][: (n + self.block_size - 1) // self.block_size]
        slots = (blocks[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)
        return slots[:n]

    @property
    def num_sample_rows(self) -> int:
        return len(self.sampled) if self.sample_counts is None else int(np.sum(self.sample_counts))

    @property
    def sample_rows(self) -> np.ndarray:
        """Indices in the step of the tokens it samples: each sampled request's last new token (its last
        `sample_counts` ones: a row after each speculative draft too)."""
        ends = np.asarray(self.query_start, dtype=np.int64)[np.asarray(self.sampled, dtype=np.int64) + 1]
        if self.sample_counts is None:
            return ends - 1
        counts = np.asarray(self.sample_counts, dtype=np.int64)
        return np.repeat(ends - counts, counts) + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)

    def sampled_only(self) -> tuple["StepLayout", np.ndarray]:
        """The step with only the sampled tokens as queries (the same contexts), and those tokens' indices in
        this step."""
        sel, rows = np.asarray(self.sampled, dtype=np.int64), self.sample_rows
        counts = np.ones(len(sel), dtype=np.int64) if self.sample_counts is None else self.sample_counts
        query_start = np.zeros(len(sel) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        layout = StepLayout(query_start=query_start, seq_lens=np.asarray(self.seq_lens)[sel],
                            block_tables=[self.block_tables[i] for i in sel], block_size=self.block_size,
                            slot_mapping=self.slot_mapping[torch.from_numpy(rows)],
                            attend_ends=None if self.attend_ends is None else self.attend_ends[rows])
        return layout, rows


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    # where a backend plans it: this step's attention for the sampled rows' queries only, every token's K and V
    # still written (the last layer's, which only the sampled rows leave)
    rows_only = None

    def for_window(self, window: int | None) -> "AttentionMetadata":
        """The plan of the layers with this sliding window (see LayeredBackend); one plan serves all here."""
        return self


class AttentionBackend:
    """Attention over the paged KV cache. The model calls `forward` once per layer per step."""

    name = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None, dtype: torch.dtype,
                 scale: float | None = None, softcap: float | None = None, kv_dtype: torch.dtype | None = None):
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype  # the caches' elements (fp8: see flock.kv.fp8)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale  # of q k^T
        self.sliding_window = sliding_window
        self.softcap = softcap  # scores become softcap * tanh(scores / softcap) (Gemma 2's), after the scale

    def for_window(self, window: int | None) -> "AttentionBackend":
        """The backend of the layers with this sliding window (see LayeredBackend); this one serves all."""
        return self

    def build_metadata(self, layout: StepLayout) -> AttentionMetadata:
        raise NotImplementedError

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D] (D + 4 for fp8 caches).
        Returns [T, H, D]."""
        raise NotImplementedError


def write_kv(k, v, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    """The step's K and V rows into their cache slots (quantized for an fp8 cache, see flock.kv.fp8)."""
    if fp8.is_fp8(k_cache.dtype):
        k, v = (fp8.quantize(x, k_cache.dtype).view(torch.uint8) for x in (k, v))
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
