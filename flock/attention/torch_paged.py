"""Per-request paged attention in PyTorch: decode tokens batched into one padded call, prefill chunks one
call each (causal against their cached context). KV is gathered by whole blocks, and every call passes
4-D tensors, which keeps PyTorch on its fused CPU kernel instead of the slow reference path."""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flock.attention.base import AttentionBackend, AttentionMetadata, StepLayout, write_kv


@dataclass
class PrefillChunk:
    start: int  # token offset in the step
    end: int
    blocks: torch.Tensor | None  # context blocks; None when the chunk is its whole context (no cache read)
    context_len: int
    mask: torch.Tensor | None  # [q, ctx] additive; None means plain causal


@dataclass
class TorchPagedMetadata(AttentionMetadata):
    decode_tokens: torch.Tensor | None  # [B] token offsets of single-token queries
    decode_blocks: torch.Tensor | None  # [B * W] block tables padded to W blocks, flattened
    decode_mask: torch.Tensor | None  # [B, 1, 1, W * block_size] additive
    prefills: list[PrefillChunk]


class TorchPagedBackend(AttentionBackend):
    name = "torch"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._buffers: list[torch.Tensor | None] = [None, None]  # K and V gather workspaces

    def build_metadata(self, layout: StepLayout) -> TorchPagedMetadata:
        self.device = layout.slot_mapping.device
        qlens = layout.query_lens
        decode_ids = np.flatnonzero(qlens == 1)
        prefills = [self._prefill_chunk(layout, int(i)) for i in np.flatnonzero(qlens > 1)]
        meta = TorchPagedMetadata(layout.slot_mapping, None, None, None, prefills)
        if len(decode_ids):
            meta.decode_tokens = torch.from_numpy(layout.query_start[decode_ids]).to(self.device)
            meta.decode_blocks, meta.decode_mask = self._decode_blocks(layout, decode_ids)
        return meta

    def _decode_blocks(self, layout: StepLayout, ids: np.ndarray):
        bs = layout.block_size
        lens = layout.seq_lens[ids]
        width = int(-(-lens.max() // bs))
        blocks = np.zeros((len(ids), width), dtype=np.int64)
        for row, i in enumerate(ids):
            table = layout.block_tables[i][: -(-int(lens[row]) // bs)]
            blocks[row, : len(table)] = table
        cols = np.arange(width * bs)
        valid = cols[None, :] < lens[:, None]
        if self.sliding_window is not None:
            valid &= cols[None, :] >= (lens - self.sliding_window)[:, None]
        return torch.from_numpy(blocks.reshape(-1)).to(self.device), self._additive(valid)[:, None, None, :]

    def _prefill_chunk(self, layout: StepLayout, i: int) -> PrefillChunk:
        start, end = int(layout.query_start[i]), int(layout.query_start[i + 1])
        n, ctx = end - start, int(layout.seq_lens[i])
        if ctx == n and self.sliding_window is None:
            return PrefillChunk(start, end, None, ctx, None)
        q_pos = np.arange(ctx - n, ctx)[:, None]
        k_pos = np.arange(ctx)[None, :]
        valid = k_pos <= q_pos
        if self.sliding_window is not None:
            valid &= k_pos > q_pos - self.sliding_window
        blocks = layout.block_tables[i][: -(-ctx // layout.block_size)]
        return PrefillChunk(start, end, torch.from_numpy(blocks).to(self.device), ctx, self._additive(valid))

    def _additive(self, valid: np.ndarray) -> torch.Tensor:
        mask = torch.zeros(valid.shape, dtype=self.dtype)
        return mask.masked_fill_(torch.from_numpy(~valid), float("-inf")).to(self.device)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchPagedMetadata) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        for c in meta.prefills:
            qc = q[c.start : c.end]
            if c.blocks is None:
                kc, vc = k[c.start : c.end], v[c.start : c.end]
            else:
                kc = self._gather(k_cache, c.blocks, 0)[: c.context_len]
                vc = self._gather(v_cache, c.blocks, 1)[: c.context_len]
            # [n, H, D] -> [1, H, n, D]
            o = self._sdpa(qc.transpose(0, 1)[None], kc.transpose(0, 1)[None], vc.transpose(0, 1)[None], c.mask)
            out[c.start : c.end] = o[0].transpose(0, 1)
        if meta.decode_tokens is not None:
            b = len(meta.decode_tokens)
            # the query heads sharing a KV head become that head's query rows: no KV expansion for GQA
            qd = q[meta.decode_tokens].view(b, self.num_kv_heads, -1, self.head_dim)
            kd = self._gather(k_cache, meta.decode_blocks, 0).view(b, -1, *k.shape[1:]).transpose(1, 2)
            vd = self._gather(v_cache, meta.decode_blocks, 1).view(b, -1, *v.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale)
            out[meta.decode_tokens] = o.view(b, self.num_heads, self.head_dim)
        return out

    def _sdpa(self, q, k, v, mask):
        gqa = self.num_heads != self.num_kv_heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=gqa)

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, slot: int) -> torch.Tensor:
        """Whole blocks of one layer's cache, in table order: [n_blocks * block_size, KVH, D].

        Copies into a reused buffer: fresh multi-MB tensors every layer cost page faults on CPUs."""
        n = len(blocks)
        buf = self._buffers[slot]
        if buf is None or buf.shape[0] < n or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = torch.empty((max(n, 1) * 5 // 4, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
            self._buffers[slot] = buf
        out = buf[:n]
        torch.index_select(cache, 0, blocks, out=out)
        return out.flatten(0, 1)
