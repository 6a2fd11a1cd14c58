"""Triton kernels for prefix-sharing (cascade) attention over the paged KV cache.

Importing this module imports triton; `triton.jit` reads TRITON_INTERPRET when it decorates the kernels
below, so to run them on the CPU with Triton's interpreter, set TRITON_INTERPRET=1 before the first import.

`cascade_attention_kernel` is one horizontally fused launch over a table of work items (built once per step
by `TritonCascadeBackend.build_metadata`), one program per (work item, KV head):
  * a prefix item takes a group's query tokens stacked (every query token of the group times the query heads
    that share the KV head, one per row) against the group's shared prefix blocks, without a mask;
  * a distinct item takes one request's query tokens (same row packing) against its own KV from its context
    offset on, causal.
Both walk the KV through the block table with an online softmax, one KV tile of BLOCK_N positions (one block
when block_size >= 16) at a time, and write a partial output and its log-sum-exp to scratch; a distinct item
of a request in no group writes its final output directly. `merge_kernel` then combines each grouped token's
prefix and distinct partials: O = (O_a e^(lse_a - m) + O_b e^(lse_b - m)) / (e^(lse_a - m) + e^(lse_b - m)).

Work item rows (int32, ITEM_FIELDS each): SEG_BEGIN (first entry of its segment in the entry lists), SEG_ROWS
(segment's rows: tokens x query heads per KV head), ROW0 (the item's first row in the segment), TABLE_BEGIN
(offset of its block table in the flat table list), KV_START, KV_END (positions attended), KIND.
Row r of a segment is entry SEG_BEGIN + r // GROUP (a query token: its index in the step and its position)
and query head kv_head * GROUP + r % GROUP.
"""

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # what triton.jit saw when decorating below

ITEM_FIELDS = 8
SEG_BEGIN, SEG_ROWS, ROW0, TABLE_BEGIN, KV_START, KV_END, KIND = range(7)
PREFIX, PARTIAL, DIRECT = 0, 1, 2  # kinds: prefix tile; distinct tile to scratch; distinct tile to the output
MIN_KV_TILE = 16  # KV positions per tile: one block, or several blocks when blocks are smaller (tl.dot's minimum)


@triton.jit
def _attend_tile(
    item, kv_head, tokens, positions, tables, q, k_cache, v_cache, out, o_part, lse_part, scale_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, CAST: tl.constexpr,
):
    seg_begin = tl.load(item + 0)
    seg_rows = tl.load(item + 1)
    row0 = tl.load(item + 2)
    table_begin = tl.load(item + 3)
    kv_start = tl.load(item + 4)
    kv_end = tl.load(item + 5)
    kind = tl.load(item + 6)
    acc_t = o_part.dtype.element_ty  # float32, or float64 for float64 inputs

    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < seg_rows
    entry = seg_begin + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    tok = tl.load(tokens + entry, mask=row_ok, other=0).to(tl.int64)
    # padding rows see every key (no causal cut), so their softmax stays finite; they are never stored
    qpos = tl.load(positions + entry, mask=row_ok, other=2147483647)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row_mask = row_ok[:, None] & d_ok[None, :]
    qt = tl.load(q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0)
    if CAST:  # float32 / float64 math (and always under the interpreter, whose 16-bit tl.dot is wrong)
        qt = qt.to(acc_t)
    scale = tl.load(scale_ptr)

    m_i = tl.full([BLOCK_M], float("-inf"), acc_t)
    l_i = tl.zeros([BLOCK_M], acc_t)
    acc = tl.zeros([BLOCK_M, BLOCK_D], acc_t)
    n = tl.arange(0, BLOCK_N)
    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + n
        k_ok = pos < kv_end
        block = tl.load(tables + table_begin + pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        # K loaded transposed: [BLOCK_D, BLOCK_N]
        kt = tl.load(
            k_cache + block[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh + d[:, None],
            mask=d_ok[:, None] & k_ok[None, :], other=0.0,
        )
        vt = tl.load(
            v_cache + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
            mask=k_ok[:, None] & d_ok[None, :], other=0.0,
        )
        if CAST:
            s = tl.dot(qt, kt.to(acc_t), input_precision="ieee")
        else:
            s = tl.dot(qt, kt)
        s = s * scale
        # prefix items: every key sits before every query of the group, so this cuts nothing there
        valid = k_ok[None, :] & (pos[None, :] <= qpos[:, None])
        s = tl.where(valid, s, float("-inf"))
        # the first tile holds KV_START, which every real row may see: m_i is finite from then on
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if CAST:
            pv = tl.dot(p, vt.to(acc_t), input_precision="ieee")
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc / l_i[:, None]

    if kind == 2:  # DIRECT: a request in no group, final output
        tl.store(out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 acc.to(out.dtype.element_ty), mask=row_mask)
    else:
        e = entry.to(tl.int64)
        tl.store(o_part + (e[:, None] * num_heads + head[:, None]) * HEAD_DIM + d[None, :], acc, mask=row_mask)
        tl.store(lse_part + e * num_heads + head, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def cascade_attention_kernel(
    items, tokens, positions, tables, q, k_cache, v_cache, out, o_part, lse_part, scale_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M_PREFIX: tl.constexpr, BLOCK_M_DISTINCT: tl.constexpr, CAST: tl.constexpr,
):
    item = items + tl.program_id(0) * 8  # ITEM_FIELDS
    kv_head = tl.program_id(1)
    # prefix and distinct programs share the launch but not the tile height
    if tl.load(item + 6) == 0:  # PREFIX
        _attend_tile(item, kv_head, tokens, positions, tables, q, k_cache, v_cache, out, o_part, lse_part,
                     scale_ptr, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                     stride_vh, stride_ot, stride_oh, num_heads,
                     HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, GROUP, BLOCK_M_PREFIX, CAST)
    else:
        _attend_tile(item, kv_head, tokens, positions, tables, q, k_cache, v_cache, out, o_part, lse_part,
                     scale_ptr, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                     stride_vh, stride_ot, stride_oh, num_heads,
                     HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, GROUP, BLOCK_M_DISTINCT, CAST)


@triton.jit
def merge_kernel(
    tokens, o_part, lse_part, out, num_partial, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program j merges entry j (a grouped token's distinct partial) with entry num_partial + j (its prefix
    partial) for every head."""
    j = tl.program_id(0)
    tok = tl.load(tokens + j).to(tl.int64)
    a = j.to(tl.int64)
    b = a + num_partial
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < num_heads
    mask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    lse_a = tl.load(lse_part + a * num_heads + h, mask=h_ok, other=0.0)
    lse_b = tl.load(lse_part + b * num_heads + h, mask=h_ok, other=0.0)
    m = tl.maximum(lse_a, lse_b)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    o_a = tl.load(o_part + (a * num_heads + h[:, None]) * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    o_b = tl.load(o_part + (b * num_heads + h[:, None]) * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    o = (o_a * w_a[:, None] + o_b * w_b[:, None]) / (w_a + w_b)[:, None]
    tl.store(out + tok * stride_ot + h[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty), mask=mask)


def cascade_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: torch.Tensor):
    """q [T, H, D] over the paged caches [num_blocks, block_size, KVH, D] as laid out by `meta` (a
    TritonCascadeMetadata); `scale` is a one-element tensor in the accumulation dtype. Returns [T, H, D]."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need a contiguous head dimension"
    t, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t == 0 or meta.num_items == 0:
        return out
    acc = scale.dtype
    rows = max(2 * meta.num_partial, 1)  # never a zero-size buffer: its pointer must be valid on CUDA
    o_part = torch.empty((rows, num_heads, head_dim), dtype=acc, device=q.device)
    lse_part = torch.empty((rows, num_heads), dtype=acc, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    cast = INTERPRETED or q.dtype in (torch.float32, torch.float64)
    cascade_attention_kernel[(meta.num_items, num_kv_heads)](
        meta.items, meta.tokens, meta.positions, meta.tables, q, k_cache, v_cache, out, o_part, lse_part, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), num_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=max(MIN_KV_TILE, meta.block_size), BLOCK_SIZE=meta.block_size,
        GROUP=num_heads // num_kv_heads, BLOCK_M_PREFIX=meta.block_m_prefix,
        BLOCK_M_DISTINCT=meta.block_m_distinct, CAST=cast, num_warps=meta.num_warps,
    )
    if meta.num_partial:
        merge_kernel[(meta.num_partial,)](
            meta.tokens, o_part, lse_part, out, meta.num_partial, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=block_d,
        )
    return out
