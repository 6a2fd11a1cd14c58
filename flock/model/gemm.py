"""Flock's bf16 GEMM (`csrc/gemm_bf16.c`) for CPUs with AVX512-BF16 and no AMX: Zen 4/5, Cooper Lake.

It multiplies by weights packed once as vdpbf16ps takes them and splits every call's register tiles evenly
over the threads; bench/step_profile.py times it against oneDNN's prepacked linear. bf16 only: fp32 models
keep oneDNN; CPUs with AMX leave bf16 to oneDNN's AMX kernels; `unavailable()` says why it does not run. A
Llama MLP's gate_up weight packed with `glu` gives silu(gate) * up straight from the GEMM's fp32 sums.
"""

import ctypes
from pathlib import Path

import torch

from flock import native

BLOCK = 64  # output columns of a packed weight block (32 with glu: each a gate and an up column)
OUT_BF16, OUT_F32, OUT_GLU = 0, 1, 2  # what flock_gemm writes

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
KERNEL = native.Library(
    Path(__file__).resolve().parent / "csrc" / "gemm_bf16.c", "the bf16 GEMM", paths=("avx512bf16",),
    signatures={"flock_gemm_pack": ([_ptr, _i64, _i64, _i32, _ptr], None),
                "flock_gemm": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i32, _i32], None)})


def unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the GEMM cannot serve a model of this dtype on this device, or None when it can."""
    if device.type != "cpu":
        return f"the bf16 GEMM is a CPU path, not {device.type}"
    if dtype != torch.bfloat16:
        return f"the bf16 GEMM takes bfloat16, not {dtype}"
    if not native.missing_flags("avx512bf16") and "amx_bf16" in native.cpu_flags():
        return "this CPU has AMX, which oneDNN uses for bf16"
    return KERNEL.unavailable("avx512bf16")


def pack(weight: torch.Tensor, glu: bool = False) -> torch.Tensor:
    """An [N, K] bf16 weight (K even) as the GEMM reads it; `glu`: its outputs are [gate | up] (N even), for
    `linear(..., glu=True)`."""
    n, k = weight.shape
    if k % 2 or weight.dtype != torch.bfloat16 or (glu and n % 2):
        raise ValueError(f"the bf16 GEMM packs bf16 weights of an even width{' and height' if glu else ''}, "
                         f"not {weight.dtype} {tuple(weight.shape)}")
    w = weight.detach().contiguous()
    blocks = -(-n // 2 // (BLOCK // 2)) if glu else -(-n // BLOCK)
    packed = torch.empty(blocks * (k // 2) * BLOCK, dtype=torch.int32)
    KERNEL.load("avx512bf16").flock_gemm_pack(w.data_ptr(), n, k, int(glu), packed.data_ptr())
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           dtype: torch.dtype = torch.bfloat16, glu: bool = False) -> torch.Tensor:
    """x W^T (+ bias) for the weight `packed` of n outputs; x: bf16 [..., K]. `dtype` float32: the fp32 sums,
    not rounded to bf16. `glu` (a weight packed so, no bias): silu(gate) * up, n = I of its 2I outputs."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or rows.stride(0) % 2:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=dtype)
    mode = OUT_GLU if glu else OUT_F32 if dtype == torch.float32 else OUT_BF16
    KERNEL.load("avx512bf16").flock_gemm(rows.data_ptr(), rows.stride(0), packed.data_ptr(), out.data_ptr(), n,
                                         rows.shape[0], n, k, mode, torch.get_num_threads())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n)
