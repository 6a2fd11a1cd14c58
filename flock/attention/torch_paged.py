"""Per-request paged attention in PyTorch: decode tokens batched into one padded call (a row that would
read far more than the others goes alone), prefill chunks one call each (causal against their cached
context). KV is gathered by whole blocks, and every call passes 4-D tensors, which keeps PyTorch on its fused
CPU kernel instead of the slow reference path.

Each request may attend to its context from a block-aligned offset on (`context_start`) and return the
log-sum-exp of its scores, so a prefix-sharing backend can attend to the shared part separately and merge.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flock.attention.base import AttentionBackend, AttentionMetadata, StepLayout, write_kv
from flock.kv import fp8


@dataclass
class PrefillChunk:
    start: int  # token offset in the step
    end: int
    blocks: torch.Tensor | None  # context blocks from the offset on; None: attend to the chunk itself
    context_len: int  # tokens attended to (from the offset)
    mask: torch.Tensor | None  # [g * q, ctx] additive (rows repeated per query head of a KV head); None: causal
    offset: int = 0  # where the attended context begins (> 0: the rest is attended elsewhere, LSE needed)


@dataclass
class TorchPagedMetadata(AttentionMetadata):
    decode_tokens: torch.Tensor | None = None  # [B] token offsets of single-token queries
    decode_blocks: torch.Tensor | None = None  # [B * W] block tables padded to W blocks, flattened
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, W * block_size] additive
    prefills: list[PrefillChunk] | None = None


class TorchPagedBackend(AttentionBackend):
    name = "torch"
    wide_decode = 4  # a decode row with more than 4x the step's median context to read is attended alone

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._buffers: list[torch.Tensor | None] = [None, None]  # K and V gather workspaces

    def build_metadata(self, layout: StepLayout, context_start: np.ndarray | None = None) -> TorchPagedMetadata:
        """`context_start[i]` (block-aligned) is where request i's attended context begins; default 0."""
        self.device = layout.slot_mapping.device
        if context_start is None:
            context_start = np.zeros(len(layout.seq_lens), dtype=np.int64)
        qlens = layout.query_lens
        alone = qlens > 1
        if layout.attend_ends is not None:  # a lone image token that attends past its position takes a mask
            alone |= layout.attend_ends[layout.query_start[:-1]] != layout.seq_lens - 1
        decode_ids, alone = np.flatnonzero(~alone), np.flatnonzero(alone)
        if len(decode_ids):  # the batched call pads every row to the widest: outliers go alone, as chunks
            width = layout.seq_lens[decode_ids] - context_start[decode_ids]
            wide = width > self.wide_decode * max(float(np.median(width)), layout.block_size)
            alone, decode_ids = np.sort(np.concatenate([alone, decode_ids[wide]])), decode_ids[~wide]
        meta = TorchPagedMetadata(layout.slot_mapping)
        meta.prefills = [self._prefill_chunk(layout, int(i), int(context_start[i])) for i in alone]
        if len(decode_ids):
            meta.decode_tokens = torch.from_numpy(layout.query_start[decode_ids]).to(self.device)
            meta.decode_blocks, meta.decode_mask = self._decode_blocks(layout, decode_ids, context_start[decode_ids])
        return meta

    def _decode_blocks(self, layout: StepLayout, ids: np.ndarray, offsets: np.ndarray):
        bs = layout.block_size
        ends = layout.seq_lens[ids]
        first = offsets // bs
        width = int((-(-ends // bs) - first).max())
        blocks = np.zeros((len(ids), width), dtype=np.int64)
        for row, i in enumerate(ids):
            table = layout.block_tables[i][first[row] : -(-int(ends[row]) // bs)]
            blocks[row, : len(table)] = table
        positions = offsets[:, None] + np.arange(width * bs)[None, :]
        valid = positions < ends[:, None]
        if self.sliding_window is not None:
            valid &= positions >= (ends - self.sliding_window)[:, None]
        return torch.from_numpy(blocks.reshape(-1)).to(self.device), self._additive(valid)[:, None, None, :]

    def _prefill_chunk(self, layout: StepLayout, i: int, offset: int) -> PrefillChunk:
        start, end = int(layout.query_start[i]), int(layout.query_start[i + 1])
        n, ctx = end - start, int(layout.seq_lens[i])
        if ctx == n and self.sliding_window is None and self.softcap is None and layout.attend_ends is None:
            return PrefillChunk(start, end, None, ctx, None)
        q_pos = np.arange(ctx - n, ctx)[:, None]
        k_pos = np.arange(offset, ctx)[None, :]
        valid = k_pos <= (q_pos if layout.attend_ends is None else layout.attend_ends[start:end, None])
        if self.sliding_window is not None:
            valid &= k_pos > q_pos - self.sliding_window
        bs = layout.block_size
        blocks = torch.from_numpy(layout.block_tables[i][offset // bs : -(-ctx // bs)]).to(self.device)
        grouped_rows = np.tile(valid, (self.num_heads // self.num_kv_heads, 1))  # see grouped_attention
        return PrefillChunk(start, end, blocks, ctx - offset, self._additive(grouped_rows), offset)

    def _additive(self, valid: np.ndarray) -> torch.Tensor:
        mask = torch.zeros(valid.shape, dtype=self.dtype)
        return mask.masked_fill_(torch.from_numpy(~valid), float("-inf")).to(self.device)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchPagedMetadata) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k, v, k_cache, v_cache, meta, lse=None)

    def attend(self, q, k, v, k_cache, v_cache, meta: TorchPagedMetadata, lse: torch.Tensor | None):
        """Attention of every query over its context range; fills `lse` ([T, H]) when given."""
        k, v = fp8.as_stored(k, k_cache), fp8.as_stored(v, v_cache)  # as later steps will read them
        out = torch.empty_like(q)
        for c in meta.prefills:
            qc = q[c.start : c.end]
            if c.blocks is None:  # the chunk is its whole context: plain causal attention
                kc, vc = k[c.start : c.end], v[c.start : c.end]
                o = F.scaled_dot_product_attention(
                    qc.transpose(0, 1)[None], kc.transpose(0, 1)[None], vc.transpose(0, 1)[None],
                    is_causal=True, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
                )
                out[c.start : c.end] = o[0].transpose(0, 1)
                continue
            kc = self._gather(k_cache, c.blocks, 0)[: c.context_len]
            vc = self._gather(v_cache, c.blocks, 1)[: c.context_len]
            want_lse = lse is not None and c.offset > 0
            out[c.start : c.end], chunk_lse = self.grouped_attention(qc, kc, vc, c.mask, want_lse)
            if want_lse:
                lse[c.start : c.end] = chunk_lse
        if meta.decode_tokens is not None:
            b = len(meta.decode_tokens)
            # the query heads sharing a KV head become that head's query rows: no KV expansion for GQA
            qd = q[meta.decode_tokens].view(b, self.num_kv_heads, -1, self.head_dim)
            kd = self._gather(k_cache, meta.decode_blocks, 0).view(b, -1, *k.shape[1:]).transpose(1, 2)
            vd = self._gather(v_cache, meta.decode_blocks, 1).view(b, -1, *v.shape[1:]).transpose(1, 2)
            o, d_lse = sdpa(qd, kd, vd, meta.decode_mask, self.scale, lse is not None, self.softcap)
            out[meta.decode_tokens] = o.reshape(b, self.num_heads, self.head_dim)
            if lse is not None:
                lse[meta.decode_tokens] = d_lse.reshape(b, self.num_heads)
        return out

    def grouped_attention(self, q, k, v, mask, want_lse: bool):
        """q [n, H, D] over k, v [ctx, KVH, D]; each KV head's g query heads stacked as g * n rows of one
        matrix (head-major), so `mask`, if any, is [g * n, ctx]. Returns [n, H, D] and, if asked, the LSE
        [n, H]."""
        n, g = q.shape[0], self.num_heads // self.num_kv_heads
        qg = q.view(n, self.num_kv_heads, g, self.head_dim).permute(1, 2, 0, 3).reshape(1, self.num_kv_heads, g * n, -1)
        o, lse = sdpa(qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, self.scale, want_lse, self.softcap)
        o = o.view(self.num_kv_heads, g, n, self.head_dim).permute(2, 0, 1, 3).reshape(n, self.num_heads, -1)
        if lse is not None:
            lse = lse.view(self.num_kv_heads, g, n).permute(2, 0, 1).reshape(n, self.num_heads)
        return o, lse

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, slot: int) -> torch.Tensor:
        """Whole blocks of one layer's cache, in table order: [n_blocks * block_size, KVH, D] (dequantized from
        an fp8 cache).

        Copies into a reused buffer: fresh multi-MB tensors every layer cost page faults on CPUs."""
        n = len(blocks)
        buf = self._buffers[slot]
        if buf is None or buf.shape[0] < n or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = torch.empty((max(n, 1) * 5 // 4, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
            self._buffers[slot] = buf
        out = buf[:n]
        torch.index_select(cache, 0, blocks, out=out)
        return fp8.dequantize(out.flatten(0, 1), self.dtype) if fp8.is_fp8(cache.dtype) else out.flatten(0, 1)


def sdpa(q, k, v, mask, scale: float, want_lse: bool, softcap: float | None = None):
    """Scaled dot-product attention of [B, Hk, L, D] queries; with `want_lse` also the float32 LSE
    [B, Hk, L] of the scores (float64 for float64 inputs). PyTorch's fused CPU kernel returns it; elsewhere,
    and with a `softcap` of the scores, which PyTorch's kernels lack, it is computed here."""
    if not want_lse and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale), None
    if q.device.type == "cpu" and softcap is None:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
        return o, lse if q.dtype == torch.float64 else lse.float()
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask.to(acc)
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.matmul(torch.exp(scores - lse[..., None]), v.to(acc))
    return o.to(q.dtype), lse
