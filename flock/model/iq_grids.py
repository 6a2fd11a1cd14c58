"""The lattice IQ types (llama.cpp's grids of 4 or 8 weights) rewritten as blocks of IQ4_XS's or Q3_K's layout with a
table of values of their own, which the int8 kernels take (flock.model.quant.transcode).

Each 32 weights of IQ1_S, IQ2_XXS, IQ3_XXS and IQ3_S, and each 16 of IQ1_M, IQ2_XS and IQ2_S, are d times an odd
integer scale 1 + 2 ls times signed grid values: IQ3_S's odd values 1..15; IQ3_XXS's even values 4..62 at a quarter of
the scale; the IQ2 types' 8, 25 and 43 at an eighth; the IQ1 types' -1, 0 and 1 plus or minus 1/8. With m 1, 2, 8
and 8 they are (d / m) (1 + 2 ls) v, v one of at most 16 integers (the type's table in csrc/quant_gemm.c: IQ3_XXS's
values halved, the IQ1 types' 8 g +- 1). A scale per 32 weights makes an IQ4_XS block (an fp16 d, a 6-bit scale less
32 per 32 weights, 4-bit indices into 16 int8 values); a scale per 16 and at most 8 values a Q3_K block (a 6-bit
scale less 32 per 16 weights, 3-bit indices into the table's first 8 values): of d, 1 + 2 ls and the values'
indices, whose kernels multiply d by 1 / m (a power of two: exact, where d / m itself might be no fp16 value). The
grids, signs and deltas are the gguf package's: its dequantizer gives v / m for blocks whose d is 1 and whose scales
are 0.
"""

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

# type id -> bytes a block, m (csrc/quant_gemm.c's d_scale of its blocks is 1 / m), weights a scale
TYPES = {int(T.IQ3_S): (110, 1, 32), int(T.IQ3_XXS): (98, 2, 32), int(T.IQ2_XXS): (66, 8, 32),
         int(T.IQ1_S): (50, 8, 32), int(T.IQ2_XS): (74, 8, 16), int(T.IQ2_S): (82, 8, 16), int(T.IQ1_M): (56, 8, 16)}
IQ4_XS_BYTES, Q3_K_BYTES = 136, 110
# IQ1_M's fp16 d is the top nibbles of its 4 uint16 scale words (at byte 48), lowest first
IQ1_M_SCALES = 48


def _take_scales(qtype: int, blocks: np.ndarray) -> np.ndarray:
    """The 4-bit (the IQ1 types: 3-bit) ls of each 32 or 16 weights, [n, 8] or [n, 16]; zeroed in `blocks`."""
    n = len(blocks)
    if qtype in (int(T.IQ3_S), int(T.IQ2_XS), int(T.IQ2_S)):  # a nibble each, low first, in the last 4 or 8 bytes
        at = {int(T.IQ3_S): 106, int(T.IQ2_XS): 66, int(T.IQ2_S): 74}[qtype]
        end = TYPES[qtype][0]
        ls = (blocks[:, at:end, None] >> np.array([0, 4], np.uint8)) & 15
        blocks[:, at:end] = 0
        return ls.reshape(n, -1)
    if qtype == int(T.IQ1_S):  # bits 12-14 of each 32 weights' uint16 at 34 (bit 15: the delta's sign, kept)
        qh = blocks[:, 34:50].copy().view(np.uint16)
        blocks[:, 34:50] = (qh & np.uint16(0x8FFF)).view(np.uint8)
        return ((qh >> 12) & 7).astype(np.uint8)
    if qtype == int(T.IQ1_M):  # 3 bits at 0, 3, 6, 9 of each uint16 (bits 12-15: d's, kept)
        words = blocks[:, IQ1_M_SCALES:56].copy().view(np.uint16)
        blocks[:, IQ1_M_SCALES:56] = (words & np.uint16(0xF000)).view(np.uint8)
        return ((words[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).astype(np.uint8).reshape(n, 16)
    # IQ3_XXS: the top 4 bits of 8 uint32 at 66; IQ2_XXS: of the second uint32 of each 32 weights' pair at 2
    at, stride = (66, 1) if qtype == int(T.IQ3_XXS) else (2, 2)
    words = blocks[:, at:at + 32 * stride].copy().view(np.uint32)
    ls = (words[:, stride - 1::stride] >> 28).astype(np.uint8)
    words[:, stride - 1::stride] &= np.uint32(0x0FFFFFFF)
    blocks[:, at:at + 32 * stride] = words.view(np.uint8)
    return ls


def _take_d(qtype: int, blocks: np.ndarray) -> np.ndarray:
    """Each block's fp16 d as 2 bytes, [n, 2]; set to 1 in `blocks`."""
    one = np.array([1.0], np.float16).view(np.uint16)[0]
    if qtype != int(T.IQ1_M):
        d = blocks[:, :2].copy()
        blocks[:, :2] = np.array([one], np.uint16).view(np.uint8)
        return d
    words = blocks[:, IQ1_M_SCALES:56].copy().view(np.uint16)
    shifts = np.array([12, 8, 4, 0], np.uint16)
    d = np.bitwise_or.reduce((words & np.uint16(0xF000)) >> shifts, axis=1).astype(np.uint16)
    words = (words & np.uint16(0x0FFF)) | ((one >> (12 - shifts)) & np.uint16(0xF)) << np.uint16(12)
    blocks[:, IQ1_M_SCALES:56] = words.view(np.uint8)
    return d.reshape(-1, 1).view(np.uint8)


def _indices(qtype: int, v: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Each value's index in the table (its first)."""
    index = np.full(256, 255, np.uint8)
    index[values.astype(np.int16)[::-1] + 128] = np.arange(len(values) - 1, -1, -1, dtype=np.uint8)
    idx = index[v + 128]
    if (idx == 255).any():
        raise ValueError(f"{T(qtype).name} values outside its table: {sorted(set(v[idx == 255].tolist()))}")
    return idx


def rewrite(qtype: int, data: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Blocks of a lattice type ([..., bytes]) as the kernel type's blocks of the same weights (IQ4_XS's for a scale
    per 32 weights, Q3_K's per 16) whose indices pick from `values` (the table's 16 int8 values), [..., bytes]."""
    size, m, per = TYPES[qtype]
    blocks = np.ascontiguousarray(data).reshape(-1, size).copy()
    n = len(blocks)
    ls = _take_scales(qtype, blocks)
    d = _take_d(qtype, blocks)
    v = np.rint(quants.dequantize(blocks, T(qtype)).reshape(n, 256) * m).astype(np.int16)
    stored = (1 + 2 * ls.astype(np.uint16)) + 32  # the scale plus 32, 6 bits
    if per == 32:
        out, out_size = _iq4_xs_blocks(d, stored, _indices(qtype, v, values)), IQ4_XS_BYTES
    else:
        out, out_size = _q3_k_blocks(d, stored, _indices(qtype, v, values[:8])), Q3_K_BYTES
    return out.reshape(*data.shape[:-1], data.shape[-1] // size * out_size)


def _iq4_xs_blocks(d: np.ndarray, stored: np.ndarray, idx: np.ndarray) -> np.ndarray:
    n = len(d)
    out = np.empty((n, IQ4_XS_BYTES), np.uint8)
    out[:, :2] = d
    out[:, 2:4] = (stored >> 4 << (2 * np.arange(8, dtype=np.uint16))).sum(1, dtype=np.uint16).reshape(n, 1) \
        .view(np.uint8)
    low = (stored & 15).astype(np.uint8)
    out[:, 4:8] = low[:, 0::2] | low[:, 1::2] << 4
    groups = idx.reshape(n, 8, 2, 16)  # weight i of each 32: byte i % 16's low (i < 16) or high nibble
    out[:, 8:] = (groups[:, :, 0] | groups[:, :, 1] << 4).reshape(n, 128)
    return out


def _q3_k_blocks(d: np.ndarray, stored: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Q3_K: hmask[32], qs[64], scales[12], d. Weight 128 h + 32 j + l: bits 2 j of qs[32 h + l] its index's low 2
    bits, bit 4 h + j of hmask[l] its third; sub-block t's scale: the nibble 4 (t // 8) of byte t % 8, above it bits
    2 (t // 4) of byte 8 + t % 4."""
    n = len(d)
    out = np.empty((n, Q3_K_BYTES), np.uint8)
    parts = idx.reshape(n, 2, 4, 32)  # h, j, l
    shifts = np.arange(4, dtype=np.uint8).reshape(1, 1, 4, 1)
    out[:, 32:96] = np.bitwise_or.reduce((parts & 3) << (2 * shifts), axis=2).reshape(n, 64)
    third = (parts >> 2).reshape(n, 8, 32)  # bit 4 h + j
    out[:, :32] = np.bitwise_or.reduce(third << np.arange(8, dtype=np.uint8).reshape(1, 8, 1), axis=1)
    t = np.arange(16)
    low = (stored & 15).astype(np.uint8) << (4 * (t // 8)).astype(np.uint8)
    out[:, 96:104] = low[:, :8] | low[:, 8:]
    high = (stored >> 4).astype(np.uint8).reshape(n, 4, 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)
    out[:, 104:108] = np.bitwise_or.reduce(high, axis=1)
    out[:, 108:110] = d
    return out
