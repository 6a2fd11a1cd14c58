"""The lattice IQ types (IQ1_S, IQ2_XXS, IQ3_XXS, IQ3_S: llama.cpp's grids of 4 or 8 weights) rewritten as blocks of
IQ4_XS's layout with a table of values of their own, which the int8 kernels take (flock.model.quant.transcode).

Each 32 weights of these types are d times an odd integer scale 1 + 2 ls times signed grid values: IQ3_S's odd values
1..15; IQ3_XXS's even values 4..62 at a quarter of the scale; IQ2_XXS's 8, 25 and 43 at an eighth; IQ1_S's -1, 0 and 1
plus or minus 1/8. With m 1, 2, 8 and 8 they are (d / m) (1 + 2 ls) v, v one of at most 16 integers (the type's table in
csrc/quant_gemm.c: IQ3_XXS's values halved, IQ1_S's 8 g +- 1): an IQ4_XS block (an fp16 d, a 6-bit scale less 32 per 32
weights, 4-bit indices into 16 int8 values) of d, 1 + 2 ls and the values' indices, whose kernels multiply d by 1 / m (a
power of two: exact, where d / m itself might be no fp16 value). The grids, signs and deltas are the gguf package's: its
dequantizer gives v / m for blocks whose d is 1 and whose scales are 0.
"""

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

# type id -> bytes a block, m (csrc/quant_gemm.c's d_scale of its IQ4_XS blocks is 1 / m)
TYPES = {int(T.IQ3_S): (110, 1), int(T.IQ3_XXS): (98, 2), int(T.IQ2_XXS): (66, 8), int(T.IQ1_S): (50, 8)}
IQ4_XS_BYTES = 136


def _take_scales(qtype: int, blocks: np.ndarray) -> np.ndarray:
    """The 4-bit (IQ1_S: 3-bit) ls of each 32 weights, [n, 8]; zeroed in `blocks`."""
    n = len(blocks)
    if qtype == int(T.IQ3_S):  # 4 bytes at 106, a nibble each, low first
        ls = (blocks[:, 106:110, None] >> np.array([0, 4], np.uint8)) & 15
        blocks[:, 106:110] = 0
        return ls.reshape(n, 8)
    if qtype == int(T.IQ1_S):  # bits 12-14 of each 32 weights' uint16 at 34 (bit 15: the delta's sign, kept)
        qh = blocks[:, 34:50].copy().view(np.uint16)
        blocks[:, 34:50] = (qh & np.uint16(0x8FFF)).view(np.uint8)
        return ((qh >> 12) & 7).astype(np.uint8)
    # IQ3_XXS: the top 4 bits of 8 uint32 at 66; IQ2_XXS: of the second uint32 of each 32 weights' pair at 2
    at, stride = (66, 1) if qtype == int(T.IQ3_XXS) else (2, 2)
    words = blocks[:, at:at + 32 * stride].copy().view(np.uint32)
    ls = (words[:, stride - 1::stride] >> 28).astype(np.uint8)
    words[:, stride - 1::stride] &= np.uint32(0x0FFFFFFF)
    blocks[:, at:at + 32 * stride] = words.view(np.uint8)
    return ls


def as_iq4_xs(qtype: int, data: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Blocks of a lattice type ([..., bytes]) as IQ4_XS's blocks of the same weights whose indices pick from
    `values` (the type's 16 int8 values), [..., blocks x 136]."""
    size, m = TYPES[qtype]
    blocks = np.ascontiguousarray(data).reshape(-1, size).copy()
    n = len(blocks)
    d = blocks[:, :2].copy()
    ls = _take_scales(qtype, blocks)
    blocks[:, :2] = np.array([1.0], np.float16).view(np.uint8)
    v = np.rint(quants.dequantize(blocks, T(qtype)).reshape(n, 256) * m).astype(np.int16)
    index = np.full(256, 255, np.uint8)
    index[values.astype(np.int16)[::-1] + 128] = np.arange(15, -1, -1, dtype=np.uint8)  # each value's first index
    idx = index[v + 128]
    if (idx == 255).any():
        raise ValueError(f"{T(qtype).name} values outside its table: {sorted(set(v[idx == 255].tolist()))}")
    out = np.empty((n, IQ4_XS_BYTES), np.uint8)
    out[:, :2] = d
    stored = (1 + 2 * ls.astype(np.uint16)) + 32  # the scale plus 32, 6 bits
    out[:, 2:4] = (stored >> 4 << (2 * np.arange(8, dtype=np.uint16))).sum(1, dtype=np.uint16).reshape(n, 1) \
        .view(np.uint8)
    low = (stored & 15).astype(np.uint8)
    out[:, 4:8] = low[:, 0::2] | low[:, 1::2] << 4
    groups = idx.reshape(n, 8, 2, 16)  # weight i of each 32: byte i % 16's low (i < 16) or high nibble
    out[:, 8:] = (groups[:, :, 0] | groups[:, :, 1] << 4).reshape(n, 128)
    return out.reshape(*data.shape[:-1], data.shape[-1] // size * IQ4_XS_BYTES)
