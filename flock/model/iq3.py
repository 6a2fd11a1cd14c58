"""IQ3_XXS and IQ3_S blocks (llama.cpp's 3-bit lattice types) rewritten as the Q6_K blocks of exactly their
values, which the int8 kernels take (flock.model.quant.transcode).

Each 32 weights of either type are d times an integer scale times signed grid values: IQ3_S's d (1 + 2 ls) times
odd values 1..15, IQ3_XXS's d (1 + 2 ls) / 4 times even values 4..62. As Q6_K (an fp16 d per 256 weights, an int8
scale per 16, weights q - 32 with q in 0..63), IQ3_S keeps d, takes 1 + 2 ls as the scale and the grid values as
the weights; IQ3_XXS takes d / 2 and the grid values halved, which holds only where d / 2 is an fp16 value
(`exact`). The grids and sign tables are the gguf package's: its dequantizer gives the signed grid values of
blocks whose d is 1 and whose scales are 0.
"""

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

TYPES = {int(T.IQ3_XXS): 98, int(T.IQ3_S): 110}  # type id -> bytes a block
SCALES_AT = {int(T.IQ3_XXS): 66, int(T.IQ3_S): 106}  # where a block's scales start
Q6_K_BYTES = 210


def _halves(blocks: np.ndarray) -> np.ndarray:
    """IQ3_XXS's d / 2 of each block, as float32 (NaN where it is no fp16 value)."""
    d = blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
    half = (d / 2).astype(np.float16).astype(np.float32)
    return np.where(half * 2 == d, half, np.nan)


def exact(qtype: int, data: np.ndarray) -> bool:
    """Whether every block of `data` (blocks of an IQ3 type, any shape) has a Q6_K block of the same values."""
    if qtype != int(T.IQ3_XXS):
        return True
    return not np.isnan(_halves(data.reshape(-1, TYPES[qtype]))).any()


def as_q6_k(qtype: int, data: np.ndarray) -> np.ndarray:
    """Blocks of IQ3_XXS or IQ3_S ([..., bytes]) as the Q6_K blocks of the same values, [..., blocks x 210]."""
    size, at = TYPES[qtype], SCALES_AT[qtype]
    blocks = np.ascontiguousarray(data).reshape(-1, size).copy()
    n = len(blocks)
    if qtype == int(T.IQ3_S):
        d = blocks[:, :2].copy().view(np.float16)[:, 0]
        ls = (blocks[:, at:at + 4, None] >> np.array([0, 4], np.uint8)) & 15
        blocks[:, at:at + 4] = 0
    else:
        d = _halves(blocks).astype(np.float16)
        if np.isnan(d).any():
            raise ValueError("IQ3_XXS blocks whose d / 2 is no fp16 value have no Q6_K blocks of their values")
        aux = blocks[:, at:at + 32].copy().view(np.uint32)
        ls = aux >> 28
        blocks[:, at:at + 32] = (aux & 0x0FFFFFFF).view(np.uint8)
    blocks[:, :2] = np.array([1.0], np.float16).view(np.uint8)
    grid = quants.dequantize(blocks, T(qtype)).reshape(n, 256)  # d 1, scales 0: the signed grid values (IQ3_XXS / 4)
    q = np.rint(grid * (2 if qtype == int(T.IQ3_XXS) else 1)).astype(np.int16) + 32
    scales = np.repeat((1 + 2 * ls.reshape(n, 8).astype(np.int16)).astype(np.int8), 2, axis=1)
    out = _q6_k(d, scales, q.astype(np.uint8))
    return out.reshape(*data.shape[:-1], data.shape[-1] // size * Q6_K_BYTES)


def _q6_k(d: np.ndarray, scales: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q6_K blocks of fp16 d [n], int8 scales [n, 16] and weights q [n, 256] (0..63) in llama.cpp's order: weight
    128 h + 32 k + l has its low 4 bits in ql[64 h + 32 (k % 2) + l] (k < 2: low nibble), its top 2 at bits 2 k of
    qh[32 h + l]."""
    n = len(q)
    v = q.reshape(n, 2, 4, 32)
    out = np.empty((n, Q6_K_BYTES), np.uint8)
    low = np.concatenate([(v[:, :, 0] & 15) | (v[:, :, 2] & 15) << 4, (v[:, :, 1] & 15) | (v[:, :, 3] & 15) << 4], 2)
    out[:, :128] = low.reshape(n, 128)
    out[:, 128:192] = ((v[:, :, 0] >> 4) | (v[:, :, 1] >> 4) << 2 | (v[:, :, 2] >> 4) << 4
                       | (v[:, :, 3] >> 4) << 6).reshape(n, 64)
    out[:, 192:208] = scales.view(np.uint8)
    out[:, 208:] = d.astype(np.float16).reshape(n, 1).view(np.uint8)
    return out
