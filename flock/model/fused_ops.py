"""Fused elementwise ops of the decoder as small C kernels (`csrc/fused_ops.c`), for bf16 and fp32 on CPUs.

RMSNorm (with the residual add folded in, or over each head of q and k), rotary embedding applied in place to q
and k of the fused qkv output, and SiLU-and-mul each replace several PyTorch ops and their intermediate tensors by
one pass over the rows; argmax (greedy sampling), `sample` (temperature) and `nucleus_sample` (top-k and top-p)
split their rows over the threads. The source is built by
flock.native on first use for the widest ISA path the CPU has (AVX-512 with DQ, AVX2 or the baseline).
`unavailable(dtype, device)` says why the kernels cannot serve a model; the plain PyTorch ops remain the reference
and serve float64 and every other case.
"""

import ctypes
import functools
from pathlib import Path

import torch

from flock import native

SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
ARGTYPES = {  # of each op, for each dtype; each ends with the number of threads
    "rms_norm": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _f32, _i32],
    "add_rms_norm": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _f32, _i32],
    "head_rms_norm": [_ptr, _i64, _ptr, _i64, _i32, _i32, _f32, _i32],
    "rope": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i32, _i32, _i32, _i32],
    "silu_and_mul": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i32],
    "gelu_and_mul": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i32],
    "scale": [_ptr, _i64, _i64, _i64, _f32, _i32],
    "add_gated": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i32],
    "argmax": [_ptr, _i64, _ptr, _i64, _i64, _i32],
    "count_above": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i32],
    "apply_bitmask": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i32],
    "sample": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i32],
    "nucleus_sample": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i32],
}
# as step-program ops (flock.model.program)
PROGRAM_OPS = ("rms_norm", "add_rms_norm", "head_rms_norm", "rope", "add_bias", "silu_and_mul", "gelu_and_mul",
               "scale", "add_gated")
KERNEL = native.Library(
    Path(__file__).resolve().parent / "csrc" / "fused_ops.c", "the fused ops",
    paths=("avx512dq", "avx2", "baseline"),
    flags=("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"),
    signatures={**{f"flock_{op}_{suffix}": (argtypes, None) for op, argtypes in ARGTYPES.items()
                   for suffix in SUFFIX.values()},
                **{f"flock_{op}_op_{suffix}": ([_ptr], _i32) for op in PROGRAM_OPS for suffix in SUFFIX.values()},
                "flock_embed_op": ([_ptr], _i32),
                "flock_run_program": ([_ptr, _i64, _i64], _i64),
                "flock_run_program_timed": ([_ptr, _i64, _i64, _ptr], _i64)})


@functools.cache
def isa() -> str:
    """The widest ISA path this CPU runs."""
    return KERNEL.runnable()[0]


def unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the fused kernels cannot run a model of this dtype on this device, or None when they can."""
    if device.type != "cpu":
        return f"the fused kernels run on CPUs, not {device.type}"
    if dtype not in SUFFIX:
        return f"the fused kernels take bfloat16 and float32, not {dtype}"
    return KERNEL.unavailable(isa())


def _kernel(op: str, dtype: torch.dtype):
    return getattr(KERNEL.load(isa()), f"flock_{op}_{SUFFIX[dtype]}")


def _check_rows(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"fused ops take 2-D tensors with contiguous rows, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_rows(x)
    out = torch.empty_like(x)
    _kernel("rms_norm", x.dtype)(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), weight.data_ptr(),
                                 x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """residual += x; x = rms_norm(residual), both in place."""
    _check_rows(x, residual)
    _kernel("add_rms_norm", x.dtype)(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                                     weight.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int, head_dim: int) -> None:
    """RMSNorm in place of each of the `heads` head_dim-wide vectors that begin every row of x (one weight for
    all heads)."""
    _check_rows(x)
    if x.shape[1] < heads * head_dim:
        raise ValueError(f"head_rms_norm_: rows of {x.shape[1]} hold fewer than {heads} heads of {head_dim}")
    _kernel("head_rms_norm", x.dtype)(x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0], heads, head_dim,
                                      eps, torch.get_num_threads())


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
          head_dim: int) -> None:
    """Rotate the first `heads` heads of every row of x in place; cos/sin: [max_positions, rotary dim] tables,
    which turn the first rotary dim dims of each head (all of them, or a partial rotary factor's share)."""
    _check_rows(x, cos)
    if cos.shape[1] > head_dim or cos.shape[1] % 2:
        raise ValueError(f"rope_: tables {cos.shape[1]} wide for heads of {head_dim}")
    if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.shape != x.shape[:1]:
        raise ValueError(f"rope_ needs one contiguous int64 position per row, got {positions.dtype} "
                         f"{tuple(positions.shape)} for {x.shape[0]} rows")
    _kernel("rope", x.dtype)(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                             cos.stride(0), x.shape[0], heads, head_dim, cos.shape[1], torch.get_num_threads())


def scale_(x: torch.Tensor, factor: float) -> None:
    """x *= factor, in place."""
    _check_rows(x)
    _kernel("scale", x.dtype)(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], factor, torch.get_num_threads())


def add_gated_(x: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> None:
    """x += sigmoid(gate) * shared, in place; gate: one value a row ([rows, 1])."""
    _check_rows(x, shared, gate)
    if not (x.shape == shared.shape and gate.shape == (x.shape[0], 1)):
        raise ValueError(f"add_gated_: x {tuple(x.shape)}, shared {tuple(shared.shape)}, gate {tuple(gate.shape)}")
    _kernel("add_gated", x.dtype)(x.data_ptr(), x.stride(0), shared.data_ptr(), shared.stride(0), gate.data_ptr(),
                                  gate.stride(0), x.shape[0], x.shape[1], torch.get_num_threads())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up]."""
    return _act_and_mul("silu_and_mul", x)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up of rows [gate | up], GELU's tanh approximation (F.gelu(approximate="tanh"))."""
    return _act_and_mul("gelu_and_mul", x)


def _act_and_mul(op: str, x: torch.Tensor) -> torch.Tensor:
    _check_rows(x)
    cols = x.shape[1] // 2
    out = torch.empty((x.shape[0], cols), dtype=x.dtype)
    _kernel(op, x.dtype)(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0], cols,
                         torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of 2-D rows (the first index of the largest value; a NaN counts as largest)."""
    _check_rows(x)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _kernel("argmax", x.dtype)(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1],
                               torch.get_num_threads())
    return out


def apply_bitmask(x: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: row rows[i] of x keeps the columns whose bit is set in row i of the int32 `bitmask` (xgrammar's
    layout, 32 columns a word), the others become -inf."""
    _check_rows(x)
    rows = rows.to(torch.int64).contiguous()
    if bitmask.dtype != torch.int32 or bitmask.stride(1) != 1 or len(bitmask) < len(rows):
        raise ValueError(f"bitmask must be int32 rows, one per row to mask, got {bitmask.dtype} {tuple(bitmask.shape)}")
    _kernel("apply_bitmask", x.dtype)(x.data_ptr(), x.stride(0), bitmask.data_ptr(), bitmask.stride(0),
                                      rows.data_ptr(), len(rows), x.shape[1], torch.get_num_threads())


def count_above(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(x > v[:, None]).sum(-1) of 2-D rows without a row-sized intermediate (PyTorch's sum widens the comparison
    to int64 first: 8 bytes a vocabulary entry)."""
    _check_rows(x)
    v, out = v.float().contiguous(), torch.empty(x.shape[0], dtype=torch.int64)
    _kernel("count_above", x.dtype)(x.data_ptr(), x.stride(0), v.data_ptr(), out.data_ptr(), x.shape[0],
                                    x.shape[1], torch.get_num_threads())
    return out


def sample(x: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of logits x drawn from softmax(x / temperature) with the row's uniform u in [0, 1)
    (float32 temperatures, float64 uniforms); -1 for a row holding a NaN or no finite maximum."""
    _check_rows(x)
    temperature, u = temperature.float().contiguous(), u.double().contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _kernel("sample", x.dtype)(x.data_ptr(), x.stride(0), temperature.data_ptr(), u.data_ptr(), out.data_ptr(),
                               x.shape[0], x.shape[1], torch.get_num_threads())
    return out


def nucleus_sample(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   u: torch.Tensor) -> torch.Tensor:
    """One token per row of logits x drawn with the row's uniform u in [0, 1) from softmax(x / temperature) cut to
    its top_k most likely tokens (0 or at least the row's width: no cut) and then to its top_p nucleus (1: none),
    tokens ranked by logit, ties by index; -1 for a row holding a NaN or no finite maximum, or tied at its k-th
    token."""
    _check_rows(x)
    temperature, u = temperature.float().contiguous(), u.double().contiguous()
    top_k, top_p = top_k.to(torch.int64).contiguous(), top_p.double().contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _kernel("nucleus_sample", x.dtype)(x.data_ptr(), x.stride(0), temperature.data_ptr(), top_k.data_ptr(),
                                       top_p.data_ptr(), u.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                                       torch.get_num_threads())
    return out
