"""Flock's bf16 GEMMs: on AMX tiles (`csrc/gemm_amx.c`; Sapphire Rapids and later) and with vdpbf16ps
(`csrc/gemm_bf16.c`; AVX512-BF16 without AMX: Zen 4/5, Cooper Lake).

Both multiply by one layout, packed once (`pack`): column blocks of 64 outputs, each [K/2][64] pairs of
weights, what vdpbf16ps takes and what an AMX B tile reads with a stride. Each splits every call's tiles evenly
over the threads; bench/step_profile.py times them against oneDNN's prepacked linear. bf16 only: fp32 models
keep oneDNN. `isa()` says which runs here, `unavailable()` why none does, `takes(k)` which widths the one here
takes (AMX: multiples of 32). A Llama MLP's gate_up weight packed with `glu` gives silu(gate) * up straight from
the GEMM's fp32 sums. EMULATED_AMX names the AMX kernel built with its tile operations in portable C: how
CPUs without AMX test its layouts; EMULATED_AMX_512 the same built for AVX512-BF16, with the amx build's own
AVX-512 epilogues (`emulated_paths()`: those this CPU runs).
"""

import ctypes
import functools
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from flock import native
from flock.model import huge_pages

BLOCK = 64  # output columns of a packed weight block (32 with glu: each a gate and an up column)
OUT_BF16, OUT_F32, OUT_GLU = 0, 1, 2  # what flock_gemm writes (csrc/gemm_lora.h also adds to a bf16 output)
EMULATED_AMX, EMULATED_AMX_512 = "emulated-amx", "avx512bf16-emulated-amx"

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
_GEMM = ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i32, _i32], _i32)
_CSRC = Path(__file__).resolve().parent / "csrc"
_OP = ([_ptr], _i32)
# a mixture layer's experts in one call (flock.model.moe): layer, x, ldx, logits, ld, is_bf16, m, y, ldy, threads
MOE_SIGNATURE = ([_ptr, _ptr, _i64, _ptr, _i64, _i32, _i64, _ptr, _i64, _i32], _i32)
# LoRA updates (flock.lora.layers): x, ldx, shrink, ranks, expand, y, ldy, m, n, k, row_ids, owners, shrunk, threads
_LORA = ([_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i32], _i32)
_SIGNATURES = {"flock_gemm": _GEMM, "flock_gemm_op": _OP, "flock_gemm_moe": MOE_SIGNATURE,
               "flock_gemm_moe_op": _OP, "flock_lora": _LORA, "flock_lora_op": _OP}
KERNEL = native.Library(_CSRC / "gemm_bf16.c", "the bf16 GEMM", paths=("avx512bf16",), signatures=_SIGNATURES)


def _amx_ready(lib: ctypes.CDLL) -> str | None:
    """None where Linux grants the tile state and a small product (two row tiles, a partial one) is right."""
    if lib.flock_amx_gemm_init() != 0:
        return native.AMX_REFUSED
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in ((17, 64), (80, 64)))
    packed, got = pack(w), torch.empty(17, 80)
    code = lib.flock_gemm(x.data_ptr(), 64, packed.data_ptr(), got.data_ptr(), 80, 17, 80, 64, OUT_F32, 1)
    if code or not torch.allclose(got.double(), x.double() @ w.double().T, rtol=1e-4, atol=1e-4):
        return f"the AMX bf16 GEMM disagrees with a float product here ({code})"
    return None


AMX = native.Library(_CSRC / "gemm_amx.c", "the AMX bf16 GEMM", paths=("amx",), ready=_amx_ready,
                     flags=("-O3", "-fopenmp", "-fno-math-errno"),
                     signatures={"flock_amx_gemm_init": ([], _i32), **_SIGNATURES})
# each emulated path's build and the ISA path it is built for
_EMULATED = {name: (replace(AMX, flags=(*AMX.flags, "-DFLOCK_EMULATED_AMX"), paths=(base,)), base)
             for name, base in ((EMULATED_AMX, "baseline"), (EMULATED_AMX_512, "avx512bf16"))}


@functools.cache
def isa() -> str | None:
    """The GEMM that runs bf16 here: "amx" on a CPU with AMX, "avx512bf16" on one with AVX512-BF16 only."""
    if "amx_bf16" in native.cpu_flags():
        return "amx" if AMX.unavailable("amx") is None else None
    return "avx512bf16" if KERNEL.unavailable("avx512bf16") is None else None


def unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the GEMM cannot serve a model of this dtype on this device, or None when it can."""
    if device.type != "cpu":
        return f"the bf16 GEMM is a CPU path, not {device.type}"
    if dtype != torch.bfloat16:
        return f"the bf16 GEMM takes bfloat16, not {dtype}"
    if "amx_bf16" in native.cpu_flags():
        return AMX.unavailable("amx")
    return KERNEL.unavailable("avx512bf16")


def takes(k: int, path: str | None = None) -> bool:
    """Whether the GEMM of `path` (default: the one here) takes an input width of k."""
    return k % (32 if (path or isa()) in ("amx", *_EMULATED) else 2) == 0


def emulated_paths() -> list[str]:
    """The emulated AMX GEMMs this CPU runs (test paths)."""
    return [name for name, (library, base) in _EMULATED.items() if base in library.runnable()]


def _lib(path: str | None) -> ctypes.CDLL:
    path = path or isa()
    if path in _EMULATED:
        library, base = _EMULATED[path]
        return library.load(base)
    return (AMX if path == "amx" else KERNEL).load(path)


def output(out: torch.Tensor | None, rows: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A GEMM's output: `out` checked, or a fresh one."""
    if out is None:
        return torch.empty((rows, n), dtype=dtype)
    if out.shape != (rows, n) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"a GEMM output must be contiguous {dtype} of shape {(rows, n)}, not {out.dtype} "
                         f"{tuple(out.shape)}")
    return out


def pack(weight: torch.Tensor, glu: bool = False) -> torch.Tensor:
    """An [N, K] bf16 weight (K even) as the GEMMs read it, zero past N; `glu`: its outputs are [gate | up]
    (N even), for `linear(..., glu=True)`: block b then holds gate outputs 32b .. 32b + 31, then the same up
    outputs."""
    n, k = weight.shape
    if k % 2 or weight.dtype != torch.bfloat16 or (glu and n % 2):
        raise ValueError(f"the bf16 GEMM packs bf16 weights of an even width{' and height' if glu else ''}, "
                         f"not {weight.dtype} {tuple(weight.shape)}")
    w = weight.detach()
    if glu:
        half = BLOCK // 2
        gate, up = (F.pad(p, (0, 0, 0, -p.shape[0] % half)).view(-1, half, k) for p in w.chunk(2))
        blocks = torch.cat([gate, up], dim=1)
    else:
        blocks = F.pad(w, (0, 0, 0, -n % BLOCK)).view(-1, BLOCK, k)
    packed = huge_pages.empty((blocks.shape[0], k // 2, BLOCK), torch.int32)  # streamed by every decode step
    return packed.copy_(blocks.contiguous().view(torch.int32).transpose(1, 2)).view(-1)


def add_lora(y: torch.Tensor, x: torch.Tensor, shrink: torch.Tensor, ranks: int, expand: torch.Tensor,
             row_ids: torch.Tensor | None, owners: torch.Tensor, path: str | None = None) -> None:
    """y += mask(x A^T) B^T in place (csrc/gemm_lora.h): `shrink` the packed [ranks, K] A, `expand` the packed
    [N, ranks] B; with `row_ids` (int64, one a row) each row's rank columns whose `owners` (int32) differ are
    zeroed first. x, y: bf16 rows, contiguous within a row; x A^T rounded to bf16, y + its product rounded once."""
    m, n = y.shape
    shrunk = x.new_empty((m, ranks))
    code = _lib(path).flock_lora(x.data_ptr(), x.stride(0), shrink.data_ptr(), ranks, expand.data_ptr(), y.data_ptr(),
                                 y.stride(0), m, n, x.shape[1], 0 if row_ids is None else row_ids.data_ptr(),
                                 owners.data_ptr(), shrunk.data_ptr(), torch.get_num_threads())
    if code:
        raise RuntimeError(f"the LoRA update ({path or isa()}) failed ({code}) on K = {x.shape[1]}")


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           dtype: torch.dtype = torch.bfloat16, glu: bool = False, path: str | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) for the weight `packed` of n outputs; x: bf16 [..., K]. `dtype` float32: the fp32 sums,
    not rounded to bf16. `glu` (a weight packed so, no bias): silu(gate) * up, n = I of its 2I outputs. `path`:
    the GEMM (default `isa()`; EMULATED_AMX). `out`: where to write x's rows (contiguous [rows, n] of `dtype`)."""
    k = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, k)  # (each PyTorch call costs a decode step 10-40 us)
    if rows.stride(-1) != 1 or rows.stride(0) % 2:
        rows = rows.contiguous()
    out = output(out, rows.shape[0], n, dtype)
    mode = OUT_GLU if glu else OUT_F32 if dtype == torch.float32 else OUT_BF16
    code = _lib(path).flock_gemm(rows.data_ptr(), rows.stride(0), packed.data_ptr(), out.data_ptr(), n,
                                 rows.shape[0], n, k, mode, torch.get_num_threads())
    if code:
        raise RuntimeError(f"the bf16 GEMM ({path or isa()}) failed ({code}) on K = {k}")
    if bias is not None:
        out += bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
