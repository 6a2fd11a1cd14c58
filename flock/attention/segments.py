"""The work of one step's prefix-sharing attention as segments, for the fused kernels (Triton and AMX).

A segment is a set of query rows against one range of KV positions, through one block table:
  * PREFIX: a group's query tokens stacked, against the group's shared prefix (no mask);
  * PARTIAL: a grouped request's query tokens against the rest of its context (causal);
  * DIRECT: an ungrouped request's query tokens against its whole context (causal).
Each segment row is a (query token, query head of one KV head) pair: row r is entry BEGIN + r // G, and the
query head kv_head * G + r % G, where G query heads share a KV head. Entries (query tokens with their
positions) are laid out [grouped requests' tokens | the same again, for the prefix | ungrouped tokens], so
the partials of grouped entry e < P are at e and e + P (P = `num_partial`), merged with their LSEs.
The groups are TorchCascadeBackend's (see `sharing.py`).
"""

from dataclasses import dataclass

import numpy as np
import torch

from flock.attention.base import StepLayout
from flock.attention.sharing import find_prefix_groups

PREFIX, PARTIAL, DIRECT = 0, 1, 2


@dataclass
class Segments:
    begin: np.ndarray  # first entry of each segment
    rows: np.ndarray  # query rows: tokens x query heads per KV head
    table: np.ndarray  # offset of its block table in `tables`
    kv_start: np.ndarray  # KV positions attended: [kv_start, kv_end)
    kv_end: np.ndarray
    first_pos: np.ndarray  # position of its first query token (PREFIX: the prefix length)
    kind: np.ndarray
    tokens: np.ndarray  # step index of every entry
    positions: np.ndarray  # position in its sequence of every entry
    attend_ends: np.ndarray | None  # the last position each entry attends (StepLayout.attend_ends; None: its own)
    tables: np.ndarray  # block tables of all requests, concatenated
    num_partial: int
    num_groups: int

    def __len__(self) -> int:
        return len(self.kind)


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], starts[i] + lengths[i])."""
    total = int(lengths.sum())
    offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return offsets + np.arange(total)


def build_segments(layout: StepLayout, heads_per_kv: int, min_prefix_blocks: int,
                   max_group_query: int | None = None, window: int | None = None) -> Segments:
    """The step's segments; requests of more than `max_group_query` new tokens (None: no limit) join no group.
    With a sliding `window` (which the kernel applies to causal rows), a request whose context is longer joins no
    group, and its segment starts at its first query's window."""
    bs = layout.block_size
    qs = np.asarray(layout.query_start, dtype=np.int64)
    seq = np.asarray(layout.seq_lens, dtype=np.int64)
    qlens = np.diff(qs)
    computed = seq - qlens
    num_req = len(seq)
    shareable = computed // bs if max_group_query is None else np.where(qlens <= max_group_query, computed // bs, 0)
    windowed = seq > window if window is not None else np.zeros(num_req, dtype=bool)
    shareable = np.where(windowed, 0, shareable)
    groups = find_prefix_groups(layout.block_tables, shareable, min_prefix_blocks)

    table_lens = np.array([len(t) for t in layout.block_tables], dtype=np.int64)
    table_begin = np.cumsum(table_lens) - table_lens
    tables = np.concatenate(layout.block_tables) if num_req else np.zeros(0, dtype=np.int64)

    grouped = np.array([i for grp in groups for i in grp.members], dtype=np.int64)
    in_group = np.zeros(num_req, dtype=bool)
    in_group[grouped] = True
    ungrouped = np.flatnonzero(~in_group)
    context_start = np.where(windowed, np.maximum(computed - (window or 0) + 1, 0), 0)
    for grp in groups:
        context_start[grp.members] = grp.num_blocks * bs

    order = np.concatenate([grouped, ungrouped])
    seg_tokens = qlens[order]
    seg_begin = np.cumsum(seg_tokens) - seg_tokens
    num_partial = int(qlens[grouped].sum())
    seg_begin[len(grouped):] += num_partial
    distinct_tok = concat_ranges(qs[order], seg_tokens)
    distinct_pos = concat_ranges(computed[order], seg_tokens)

    # one segment per request (distinct), one per group (prefix)
    group_sizes = np.array([len(grp.members) for grp in groups], dtype=np.int64)
    group_tokens = np.add.reduceat(qlens[grouped], np.cumsum(group_sizes) - group_sizes) if len(groups) else \
        np.zeros(0, dtype=np.int64)
    leaders = np.array([grp.members[0] for grp in groups], dtype=np.int64)
    prefix_len = np.array([grp.num_blocks * bs for grp in groups], dtype=np.int64)
    return Segments(
        begin=np.concatenate([seg_begin, num_partial + np.cumsum(group_tokens) - group_tokens]),
        rows=np.concatenate([seg_tokens, group_tokens]) * heads_per_kv,
        table=np.concatenate([table_begin[order], table_begin[leaders]]),
        kv_start=np.concatenate([context_start[order], np.zeros(len(groups), dtype=np.int64)]),
        kv_end=np.concatenate([seq[order], prefix_len]),
        first_pos=np.concatenate([computed[order], prefix_len]),
        kind=np.concatenate([np.where(in_group[order], PARTIAL, DIRECT), np.full(len(groups), PREFIX)]),
        tokens=np.concatenate([distinct_tok[:num_partial], distinct_tok]),
        positions=np.concatenate([distinct_pos[:num_partial], distinct_pos]),
        attend_ends=None if layout.attend_ends is None else layout.attend_ends[np.concatenate(
            [distinct_tok[:num_partial], distinct_tok])],
        tables=tables,
        num_partial=num_partial,
        num_groups=len(groups),
    )


def int32(a: np.ndarray) -> torch.Tensor:
    """A contiguous int32 tensor for the C kernels."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


class PartialBuffers:
    """The fused kernels' fp32 partial outputs and LSEs, reused across layers and steps (fresh MBs for each
    layer would fault their pages in again)."""

    def __init__(self, num_heads: int, head_dim: int):
        self.num_heads, self.head_dim = num_heads, head_dim
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def get(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lse is None or self.lse.shape[0] < rows:
            n = max(rows, 1) * 5 // 4 + 1
            self.out, self.lse = torch.empty((n, self.num_heads, self.head_dim)), torch.empty((n, self.num_heads))
        return self.out, self.lse
