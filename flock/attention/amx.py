"""Prefix-sharing (cascade) attention for bf16 on x86 CPUs with AMX: one fused C kernel per layer.

The kernel (`csrc/cascade_amx.c`) takes the step's segments (`segments.py`: each group's stacked queries
against its shared prefix, each request's queries against the rest of its context) and runs them on all
threads of PyTorch's OpenMP pool: matrix products on AMX tiles, softmax in fp32 with AVX-512, KV read from
the paged blocks in place, then merges each grouped token's two partials. It is built and loaded by
flock.native on first use.

Where the kernel is not used, the backend is TorchCascadeBackend, exactly: another dtype or device, a
sliding window, a head_dim that is not a multiple of 32 (or above 256), or a CPU without AMX / no gcc
(`kernel_unavailable()` says why).
"""

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flock import native
from flock.attention.base import AttentionMetadata, StepLayout, write_kv
from flock.attention.cascade import TorchCascadeBackend
from flock.attention.segments import PartialBuffers, build_segments, int32


class _Args(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("q_stride_t", ctypes.c_int64), ("q_stride_h", ctypes.c_int64),
        ("kv_stride_b", ctypes.c_int64), ("kv_stride_s", ctypes.c_int64), ("kv_stride_h", ctypes.c_int64),
        ("segs", ctypes.c_void_p), ("tokens", ctypes.c_void_p), ("positions", ctypes.c_void_p),
        ("tables", ctypes.c_void_p), ("num_segs", ctypes.c_int32), ("num_partial", ctypes.c_int32),
        ("out", ctypes.c_void_p), ("out_stride_t", ctypes.c_int64), ("out_stride_h", ctypes.c_int64),
        ("o_part", ctypes.c_void_p), ("lse_part", ctypes.c_void_p),
        ("num_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32), ("scale", ctypes.c_float),
    ]


def _tiles_granted(lib: ctypes.CDLL) -> str | None:
    return None if lib.flock_amx_init() == 0 else native.AMX_REFUSED


KERNEL = native.Library(
    Path(__file__).resolve().parent / "csrc" / "cascade_amx.c", "the AMX kernel", paths=("amx",),
    signatures={"flock_amx_init": ([], ctypes.c_int), "flock_amx_cascade": ([ctypes.POINTER(_Args)], ctypes.c_int)},
    ready=_tiles_granted)


def takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs attention of this dtype and head size (on a CPU that has it)."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256


def kernel_unavailable() -> str | None:
    """Why the AMX kernel cannot run here, or None when it can."""
    return KERNEL.unavailable("amx")


@dataclass
class AmxMetadata(AttentionMetadata):
    segs: torch.Tensor  # [S, 6] int32 (begin, rows, table, kv_start, kv_end, kind), heaviest first
    tokens: torch.Tensor  # int32 step index of every entry
    positions: torch.Tensor  # int32 position of every entry
    tables: torch.Tensor  # int32 block tables, concatenated
    num_partial: int
    block_size: int


class AmxCascadeBackend(TorchCascadeBackend):
    name = "amx"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.partials = PartialBuffers(self.num_heads, self.head_dim)

    def uses_kernel(self, device: torch.device) -> bool:
        return (device.type == "cpu" and self.sliding_window is None and takes(self.dtype, self.head_dim)
                and kernel_unavailable() is None)

    def build_metadata(self, layout: StepLayout):
        if not self.uses_kernel(layout.slot_mapping.device):
            return super().build_metadata(layout)
        s = build_segments(layout, self.num_heads // self.num_kv_heads, self.min_prefix_blocks)
        segs = np.stack([s.begin, s.rows, s.table, s.kv_start, s.kv_end, s.kind], axis=1)
        work = (s.kv_end - s.kv_start) * s.rows
        segs = segs[np.argsort(-work, kind="stable")]  # longest first: dynamic scheduling balances the tail
        return AmxMetadata(layout.slot_mapping, int32(segs), int32(s.tokens), int32(s.positions),
                           int32(s.tables), s.num_partial, layout.block_size)

    def forward(self, q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
        if not isinstance(meta, AmxMetadata):
            return super().forward(q, k, v, k_cache, v_cache, meta)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError("the AMX kernel needs K and V caches of one layout with contiguous heads")
        out = torch.empty(q.shape, dtype=q.dtype)
        o_part, lse_part = self.partials.get(2 * meta.num_partial)
        args = _Args(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q.stride(0), q.stride(1),
            *k_cache.stride()[:3], meta.segs.data_ptr(), meta.tokens.data_ptr(), meta.positions.data_ptr(),
            meta.tables.data_ptr(), len(meta.segs), meta.num_partial, out.data_ptr(), out.stride(0), out.stride(1),
            o_part.data_ptr(), lse_part.data_ptr(), self.num_heads, self.num_kv_heads, self.head_dim,
            meta.block_size, self.scale,
        )
        code = KERNEL.load("amx").flock_amx_cascade(ctypes.byref(args))
        if code != 0:
            raise RuntimeError(f"AMX cascade kernel failed ({code})")
        return out
