"""Prefix-sharing (cascade) attention as one fused Triton launch, after BatchLLM's horizontal fusion.

The groups are TorchCascadeBackend's (requests whose block tables begin with the same physical blocks, see
`sharing.py`). Every step, `build_metadata` turns them into a table of work items (int32, built once per
step and copied to the device in one transfer); every layer, `forward` launches one kernel in which some
programs attend a group's stacked queries to its shared prefix and the others each request's queries to the
rest of its context, then a small kernel merges the two partial results of every grouped token with their
log-sum-exps (see `triton_kernels.py`).

Where the kernel is not used, the backend is TorchCascadeBackend, exactly:
  * a sliding window (the prefix part would need a mask);
  * float64 on a GPU (the kernel computes in float64 only under Triton's CPU interpreter, where it is tested);
  * a CPU device without TRITON_INTERPRET=1 (Triton compiles for GPUs only), or triton not installed.
The block size must be a power of two. Importing this module does not import triton.
"""

import importlib.util
import os
from dataclasses import dataclass

import numpy as np
import torch

from flock.attention.base import AttentionMetadata, StepLayout, write_kv
from flock.attention.cascade import TorchCascadeBackend
from flock.attention.sharing import find_prefix_groups

ITEM_FIELDS = 8  # triton_kernels.ITEM_FIELDS; repeated here so that building the tables needs no triton
PREFIX, PARTIAL, DIRECT = 0, 1, 2
MAX_BLOCK_M = 64


@dataclass
class TritonCascadeMetadata(AttentionMetadata):
    items: torch.Tensor  # [num_items, ITEM_FIELDS] int32 work items
    tokens: torch.Tensor  # [E] int32 step index of every entry (query token of a segment)
    positions: torch.Tensor  # [E] int32 position in its sequence of every entry
    tables: torch.Tensor  # int32 block tables of all requests, concatenated
    num_items: int
    num_partial: int  # grouped query tokens: entries [0, P) distinct partials, [P, 2P) their prefix partials
    block_size: int
    block_m_prefix: int
    block_m_distinct: int
    num_warps: int
    num_groups: int


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], starts[i] + lengths[i])."""
    total = int(lengths.sum())
    offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return offsets + np.arange(total)


def _tile_rows(max_rows: int) -> int:
    return int(min(MAX_BLOCK_M, max(16, 1 << max(0, int(max_rows) - 1).bit_length())))


class TritonCascadeBackend(TorchCascadeBackend):
    name = "triton"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kernels = None
        self._scales: dict = {}

    # -- which path ------------------------------------------------------------------------------------------
    def uses_kernel(self, device: torch.device) -> bool:
        if self.sliding_window is not None or importlib.util.find_spec("triton") is None:
            return False
        if device.type == "cuda":
            return self.dtype != torch.float64
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
            return self.kernels().INTERPRETED  # decorated before TRITON_INTERPRET was set: compiled kernels
        return False

    def kernels(self):
        if self._kernels is None:
            from flock.attention import triton_kernels

            self._kernels = triton_kernels
        return self._kernels

    # -- per step --------------------------------------------------------------------------------------------
    def build_metadata(self, layout: StepLayout):
        device = layout.slot_mapping.device
        if not self.uses_kernel(device):
            return super().build_metadata(layout)
        bs = layout.block_size
        if bs <= 0 or bs & (bs - 1):
            raise ValueError(f"the triton backend needs a power-of-two block size, got {bs}")
        g = self.num_heads // self.num_kv_heads
        qs = np.asarray(layout.query_start, dtype=np.int64)
        seq = np.asarray(layout.seq_lens, dtype=np.int64)
        qlens = np.diff(qs)
        computed = seq - qlens
        num_req = len(seq)
        groups = find_prefix_groups(layout.block_tables, computed // bs, self.min_prefix_blocks)

        table_lens = np.array([len(t) for t in layout.block_tables], dtype=np.int64)
        table_begin = np.cumsum(table_lens) - table_lens
        tables = np.concatenate(layout.block_tables) if num_req else np.zeros(0, dtype=np.int64)

        grouped = np.array([i for grp in groups for i in grp.members], dtype=np.int64)
        in_group = np.zeros(num_req, dtype=bool)
        in_group[grouped] = True
        ungrouped = np.flatnonzero(~in_group)
        context_start = np.zeros(num_req, dtype=np.int64)
        for grp in groups:
            context_start[grp.members] = grp.num_blocks * bs

        # entries: [grouped requests' tokens | the same again, for the prefix | ungrouped requests' tokens]
        order = np.concatenate([grouped, ungrouped])
        seg_tokens = qlens[order]
        seg_begin = np.cumsum(seg_tokens) - seg_tokens
        num_partial = int(qlens[grouped].sum())
        seg_begin[len(grouped):] += num_partial
        distinct_tok = _ranges(qs[order], seg_tokens)
        distinct_pos = _ranges(computed[order], seg_tokens)
        tokens = np.concatenate([distinct_tok[:num_partial], distinct_tok])
        positions = np.concatenate([distinct_pos[:num_partial], distinct_pos])

        # segments: one per request (distinct), one per group (prefix)
        group_sizes = np.array([len(grp.members) for grp in groups], dtype=np.int64)
        group_tokens = np.add.reduceat(qlens[grouped], np.cumsum(group_sizes) - group_sizes) if len(groups) else \
            np.zeros(0, dtype=np.int64)
        leaders = np.array([grp.members[0] for grp in groups], dtype=np.int64)
        prefix_len = np.array([grp.num_blocks * bs for grp in groups], dtype=np.int64)
        seg = {
            "begin": np.concatenate([seg_begin, num_partial + np.cumsum(group_tokens) - group_tokens]),
            "rows": np.concatenate([seg_tokens, group_tokens]) * g,
            "table": np.concatenate([table_begin[order], table_begin[leaders]]),
            "kv_start": np.concatenate([context_start[order], np.zeros(len(groups), dtype=np.int64)]),
            "kv_end": np.concatenate([seq[order], prefix_len]),
            "first_pos": np.concatenate([computed[order], prefix_len]),  # bounds the causal cut below
            "kind": np.concatenate([np.where(in_group[order], PARTIAL, DIRECT), np.full(len(groups), PREFIX)]),
        }
        is_prefix = seg["kind"] == PREFIX
        bm_prefix = _tile_rows(seg["rows"][is_prefix].max(initial=1))
        bm_distinct = _tile_rows(seg["rows"][~is_prefix].max(initial=1))
        seg_bm = np.where(is_prefix, bm_prefix, bm_distinct)

        # work items: each segment cut into tiles of its kind's height
        per_seg = -(-seg["rows"] // seg_bm)
        which = np.repeat(np.arange(len(per_seg)), per_seg)
        row0 = (np.arange(int(per_seg.sum())) - np.repeat(np.cumsum(per_seg) - per_seg, per_seg)) * seg_bm[which]
        last_row = np.minimum(row0 + seg_bm[which], seg["rows"][which]) - 1
        # a tile's queries see nothing past its last query's position (prefix tiles: past the prefix)
        kv_end = np.minimum(seg["kv_end"][which], seg["first_pos"][which] + last_row // g + 1)
        items = np.zeros((len(which), ITEM_FIELDS), dtype=np.int64)
        items[:, 0] = seg["begin"][which]
        items[:, 1] = seg["rows"][which]
        items[:, 2] = row0
        items[:, 3] = seg["table"][which]
        items[:, 4] = seg["kv_start"][which]
        items[:, 5] = kv_end
        items[:, 6] = seg["kind"][which]
        items = items[np.argsort(items[:, 4] - items[:, 5], kind="stable")]  # longest first

        flat = np.concatenate([items.reshape(-1), tokens, positions, tables]).astype(np.int32)
        dev = torch.from_numpy(flat).to(device)
        a = items.size
        b = a + len(tokens)
        c = b + len(positions)
        block_d = max(16, 1 << (self.head_dim - 1).bit_length())
        return TritonCascadeMetadata(
            layout.slot_mapping, items=dev[:a], tokens=dev[a:b], positions=dev[b:c], tables=dev[c:],
            num_items=len(items), num_partial=num_partial, block_size=bs, block_m_prefix=bm_prefix,
            block_m_distinct=bm_distinct, num_warps=8 if max(bm_prefix, bm_distinct) * block_d >= 64 * 128 else 4,
            num_groups=len(groups),
        )

    # -- per layer -------------------------------------------------------------------------------------------
    def forward(self, q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
        if not isinstance(meta, TritonCascadeMetadata):
            return super().forward(q, k, v, k_cache, v_cache, meta)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.kernels().cascade_attention(q, k_cache, v_cache, meta, self._scale(q))

    def _scale(self, q: torch.Tensor) -> torch.Tensor:
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        key = (q.device, acc)
        if key not in self._scales:
            self._scales[key] = torch.tensor([self.scale], dtype=acc, device=q.device)
        return self._scales[key]
