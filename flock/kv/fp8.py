"""fp8 KV caches (`kv_cache_dtype` fp8, fp8_e4m3 or fp8_e5m2, vLLM's names; fp8 is e4m3).

Each (token, KV head) row of K and of V is stored as head_dim fp8 codes followed by its fp32 scale (4 bytes, in the
same row of the cache tensor, whose last dimension is head_dim + 4): the row's largest |x| over the format's
largest value, so that every row uses the format's whole range. A token's KV then takes (head_dim + 4) / (2
head_dim) of its bf16 bytes (0.53 at head_dim 64), and the same memory holds nearly twice the tokens. vLLM keeps
one scale per layer (1.0 unless the checkpoint brings one); a scale per row keeps small values' precision.

Every attention backend reads what the cache holds: K and V as `dequantize(quantize(x))`, the current step's
tokens included. These functions are the reference; the CPU kernel (attention/csrc/kv_fp8.h) does the same
arithmetic, to the bit.
"""

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALE_BYTES = 4


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The caches' element type: the model's for "auto", else the fp8 format (EngineConfig checked the name)."""
    return model_dtype if kv_cache_dtype == "auto" else FP8[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of a cache of `dtype`."""
    return head_dim + SCALE_BYTES if is_fp8(dtype) else head_dim


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., D] as fp8 rows [..., D + 4] of `dtype`: codes of x / scale (rounded to the nearest even,
    saturated), then the scale's bytes."""
    x = x.float()
    top = torch.finfo(dtype).max
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    codes = (x / scale).clamp(-top, top).to(dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], -1).view(dtype)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 rows [..., D + 4] as values [..., D] of `dtype` (codes times scale in fp32, then rounded)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows.view(torch.uint8)[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x [..., D] as a cache of cache's dtype gives it back."""
    return dequantize(quantize(x, cache.dtype), x.dtype) if is_fp8(cache.dtype) else x
