"""Per-request paged attention in PyTorch: decode tokens batched into one padded call, prefill chunks one
call each (causal against their cached context)."""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flock.attention.base import AttentionBackend, AttentionMetadata, StepLayout, write_kv


@dataclass
class PrefillChunk:
    start: int  # token offset in the step
    end: int
    slots: torch.Tensor | None  # context slots, None when the chunk is the whole context
    mask: torch.Tensor | None  # [q, ctx] bool, None means plain causal


@dataclass
class TorchPagedMetadata(AttentionMetadata):
    decode_tokens: torch.Tensor | None  # [B] token offsets of decode queries
    decode_slots: torch.Tensor | None  # [B, L] context slots, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] bool, None when no padding is needed
    prefills: list[PrefillChunk]


class TorchPagedBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, layout: StepLayout) -> TorchPagedMetadata:
        self.device = layout.slot_mapping.device
        qlens = layout.query_lens
        decode_ids = np.flatnonzero(qlens == 1)
        prefills = [self._prefill_chunk(layout, int(i)) for i in np.flatnonzero(qlens > 1)]
        decode_tokens = decode_slots = decode_mask = None
        if len(decode_ids):
            decode_tokens = torch.from_numpy(layout.query_start[decode_ids]).to(self.device)
            decode_slots, decode_mask = self._decode_slots(layout, decode_ids)
        return TorchPagedMetadata(layout.slot_mapping, decode_tokens, decode_slots, decode_mask, prefills)

    def _decode_slots(self, layout: StepLayout, ids: np.ndarray):
        lens = layout.seq_lens[ids]
        width = int(lens.max())
        slots = np.zeros((len(ids), width), dtype=np.int64)
        for row, i in enumerate(ids):
            slots[row, : lens[row]] = layout.context_slots(int(i))
        cols = np.arange(width)
        valid = cols[None, :] < lens[:, None]
        if self.sliding_window is not None:
            valid &= cols[None, :] >= (lens - self.sliding_window)[:, None]
        mask = None if valid.all() else torch.from_numpy(valid)[:, None, None, :].to(self.device)
        return torch.from_numpy(slots).to(self.device), mask

    def _prefill_chunk(self, layout: StepLayout, i: int) -> PrefillChunk:
        start, end = int(layout.query_start[i]), int(layout.query_start[i + 1])
        n, ctx = end - start, int(layout.seq_lens[i])
        if ctx == n and self.sliding_window is None:
            return PrefillChunk(start, end, None, None)
        q_pos = np.arange(ctx - n, ctx)[:, None]
        k_pos = np.arange(ctx)[None, :]
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask &= k_pos > q_pos - self.sliding_window
        slots = torch.from_numpy(layout.context_slots(i)).to(self.device)
        return PrefillChunk(start, end, slots, torch.from_numpy(mask).to(self.device))

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchPagedMetadata) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        for chunk in meta.prefills:
            qc = q[chunk.start : chunk.end]
            if chunk.slots is None:
                kc, vc = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
            else:
                kc, vc = k_flat[chunk.slots], v_flat[chunk.slots]
            out[chunk.start : chunk.end] = self._attend(qc, kc, vc, chunk.mask, causal=chunk.mask is None)
        if meta.decode_tokens is not None:
            qd = q[meta.decode_tokens].unsqueeze(2)  # [B, H, 1, D]
            kd = k_flat[meta.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
            vd = v_flat[meta.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True
            )
            out[meta.decode_tokens] = o.squeeze(2)
        return out

    def _attend(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        # [n, H, D] x [ctx, KVH, D] -> [n, H, D]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True,
        )
        return o.transpose(0, 1)
