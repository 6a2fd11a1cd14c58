"""Prefix-sharing (cascade) attention as one fused Triton launch, after BatchLLM's horizontal fusion.

The groups are TorchCascadeBackend's (requests whose block tables begin with the same physical blocks, see
`sharing.py`). Every step, `build_metadata` turns them into a table of work items (int32, built once per
step and copied to the device in one transfer); every layer, `forward` launches one kernel in which some
programs attend a group's stacked queries to its shared prefix and the others each request's queries to the
rest of its context, then a small kernel merges the two partial results of every grouped token with their
log-sum-exps (see `triton_kernels.py`).

Where the kernel is not used, the backend is TorchCascadeBackend, exactly:
  * a sliding window (the prefix part would need a mask);
  * an fp8 KV cache (flock.kv.fp8);
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
from flock.attention.segments import PREFIX, build_segments

ITEM_FIELDS = 8  # triton_kernels.ITEM_FIELDS; repeated here so that building the tables needs no triton
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
        if (self.sliding_window is not None or self.softcap is not None or self.kv_dtype != self.dtype
                or importlib.util.find_spec("triton") is None):
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
        if not self.uses_kernel(device) or layout.attend_ends is not None:  # image tokens: the torch path's masks
            return super().build_metadata(layout)
        bs = layout.block_size
        if bs <= 0 or bs & (bs - 1):
            raise ValueError(f"the triton backend needs a power-of-two block size, got {bs}")
        g = self.num_heads // self.num_kv_heads
        segs = build_segments(layout, g, self.min_prefix_blocks)
        is_prefix = segs.kind == PREFIX
        bm_prefix = _tile_rows(segs.rows[is_prefix].max(initial=1))
        bm_distinct = _tile_rows(segs.rows[~is_prefix].max(initial=1))
        seg_bm = np.where(is_prefix, bm_prefix, bm_distinct)

        # work items: each segment cut into tiles of its kind's height
        per_seg = -(-segs.rows // seg_bm)
        which = np.repeat(np.arange(len(per_seg)), per_seg)
        row0 = (np.arange(int(per_seg.sum())) - np.repeat(np.cumsum(per_seg) - per_seg, per_seg)) * seg_bm[which]
        last_row = np.minimum(row0 + seg_bm[which], segs.rows[which]) - 1
        # a tile's queries see nothing past its last query's position (prefix tiles: past the prefix)
        kv_end = np.minimum(segs.kv_end[which], segs.first_pos[which] + last_row // g + 1)
        items = np.zeros((len(which), ITEM_FIELDS), dtype=np.int64)
        items[:, 0] = segs.begin[which]
        items[:, 1] = segs.rows[which]
        items[:, 2] = row0
        items[:, 3] = segs.table[which]
        items[:, 4] = segs.kv_start[which]
        items[:, 5] = kv_end
        items[:, 6] = segs.kind[which]
        items = items[np.argsort(items[:, 4] - items[:, 5], kind="stable")]  # longest first

        flat = np.concatenate([items.reshape(-1), segs.tokens, segs.positions, segs.tables]).astype(np.int32)
        dev = torch.from_numpy(flat).to(device)
        a = items.size
        b = a + len(segs.tokens)
        c = b + len(segs.positions)
        block_d = max(16, 1 << (self.head_dim - 1).bit_length())
        return TritonCascadeMetadata(
            layout.slot_mapping, items=dev[:a], tokens=dev[a:b], positions=dev[b:c], tables=dev[c:],
            num_items=len(items), num_partial=segs.num_partial, block_size=bs, block_m_prefix=bm_prefix,
            block_m_distinct=bm_distinct, num_warps=8 if max(bm_prefix, bm_distinct) * block_d >= 64 * 128 else 4,
            num_groups=segs.num_groups,
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
