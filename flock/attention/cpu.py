"""Prefix-sharing (cascade) attention on x86-64 CPUs: one fused C kernel per layer, for prefill and decode.

The kernel (`csrc/cascade_cpu.c`) is one source built once per ISA path, the best one this CPU runs chosen at
run time (FLOCK_CPU_ISA forces one): `amx` (bf16 products on AMX tiles), `avx512bf16` (bf16 products by
vdpbf16ps), `avx512` (AVX-512F) or `avx2` (AVX2 + FMA), each for bf16 and fp32. EMULATED_AMX is the
`amx` path built on AVX2 with its tile operations in portable C, how CPUs without AMX test it; EMULATED_AMX_512
the same on AVX512-BF16, which runs the `amx` build's own AVX-512 code around the tiles. Work comes as the
step's segments (`segments.py`: each group's stacked queries against its shared prefix, each request's queries
against the rest of its context, causal), KV read from the paged blocks in place, the partials merged by
log-sum-exp in the same call; a segment that would keep one thread busy alone (one long context, few KV heads)
is split by KV range into pieces merged the same way. It runs on PyTorch's OpenMP threads and is built and
loaded by flock.native on first use. fp8 caches (flock.kv.fp8) are quantized by its KV write and converted back
where it repacks their chunks.

A sliding window (Mistral's, Phi-3's) masks each causal row's positions before its window in the kernel; requests
whose context passes the window join no prefix group (a group's prefix part has no mask).

Where the kernel is not used, the backend is TorchCascadeBackend, exactly: float64 or another device, a head_dim
that is not a multiple of 16 (or above 256), or no usable ISA path or gcc (`kernel_unavailable()` says why).
"""

import ctypes
import functools
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from flock import native
from flock.attention.base import AttentionMetadata, StepLayout, write_kv
from flock.attention.cascade import TorchCascadeBackend
from flock.attention.segments import DIRECT, PREFIX, PartialBuffers, Segments, build_segments, concat_ranges, int32
from flock.kv import fp8

MAX_PARTS = 16  # KV pieces a segment is split into, at most (the kernel merges up to 64 partials per token)
# Requests with more new tokens than this join no prefix group: their rows fill the tiles alone, and a group's
# stacked prefix rows, partials and merges cost their prefill more than the prefix reads it saves.
MAX_GROUP_QUERY = 16


class _Args(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("q_stride_t", ctypes.c_int64), ("q_stride_h", ctypes.c_int64),
        ("kv_stride_b", ctypes.c_int64), ("kv_stride_s", ctypes.c_int64), ("kv_stride_h", ctypes.c_int64),
        ("segs", ctypes.c_void_p), ("tokens", ctypes.c_void_p), ("positions", ctypes.c_void_p),
        ("tables", ctypes.c_void_p), ("num_segs", ctypes.c_int32),
        ("out", ctypes.c_void_p), ("out_stride_t", ctypes.c_int64), ("out_stride_h", ctypes.c_int64),
        ("o_part", ctypes.c_void_p), ("lse_part", ctypes.c_void_p),
        ("merge_offsets", ctypes.c_void_p), ("merge_slots", ctypes.c_void_p), ("merge_tokens", ctypes.c_void_p),
        ("num_merges", ctypes.c_int32),
        ("num_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32), ("scale", ctypes.c_float), ("bf16", ctypes.c_int32),
        ("window", ctypes.c_int32), ("softcap", ctypes.c_float), ("kv_format", ctypes.c_int32),
        ("attend_ends", ctypes.c_void_p), ("direct_rows", ctypes.c_int32),
    ]


_p, _i64, _int, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int32
KV_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # the kernel's fp8 caches (else 0: q's dtype)


def direct_rows() -> int:
    """Units of at most this many rows (decode when few query heads share a KV head) read bf16 K and V rows in
    place instead of repacking them: two, but none on AMD's Zen 4 (family 25), whose double-pumped 512-bit units
    repack them faster (bench/attention_decode, heads of 64 and 128: 1.3x without sharing). The amx path reads
    units of up to 16 rows in place on its tiles whatever this says."""
    return 0 if native.cpu_vendor_family() == ("AuthenticAMD", 25) else 2


def _ready(lib: ctypes.CDLL) -> str | None:
    """None where the build may run: on AMX builds, Linux grants the tile state and a causal bf16 prefill (40
    tokens, 3 blocks, 2 query heads on one KV head) matches float attention."""
    if lib.flock_cpu_init() != 0:
        return native.AMX_REFUSED
    if not lib.flock_cpu_tiles():
        return None
    tokens, heads, dim, block = 40, 2, 64, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, h, dim, generator=gen).to(torch.bfloat16) for h in (heads, 1, 1))
    k_cache, v_cache = (torch.zeros(3 * block, 1, dim, dtype=torch.bfloat16) for _ in range(2))
    k_cache[:tokens], v_cache[:tokens] = k, v
    index = torch.arange(tokens, dtype=torch.int32)
    segs = torch.tensor([[0, tokens * heads, 0, 0, tokens, 1, -1]], dtype=torch.int32)
    tables, none, out = torch.arange(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.empty_like(q)
    part = torch.zeros(heads * dim)
    args = _Args(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), heads * dim, dim, block * dim, dim, dim,
                 segs.data_ptr(), index.data_ptr(), index.data_ptr(), tables.data_ptr(), 1, out.data_ptr(),
                 heads * dim, dim, part.data_ptr(), part.data_ptr(), none.data_ptr(), none.data_ptr(),
                 none.data_ptr(), 0, heads, 1, dim, block, dim**-0.5, 1)
    code = lib.flock_cpu_cascade(ctypes.byref(args))
    scores = torch.einsum("thd,sd->hts", q.double(), k[:, 0].double()) * dim**-0.5
    weights = scores.masked_fill(torch.ones(tokens, tokens).triu(1).bool(), float("-inf")).softmax(-1)
    expected = torch.einsum("hts,sd->thd", weights, v[:, 0].double())
    if code or not torch.allclose(out.double(), expected, rtol=2e-2, atol=2e-2):
        return f"the AMX attention kernel disagrees with float attention here ({code})"
    return None


KERNEL = native.Library(
    Path(__file__).resolve().parent / "csrc" / "cascade_cpu.c", "the {path} kernel",
    paths=("amx", "avx512bf16", "avx512", "avx2"), ready=_ready,
    signatures={"flock_cpu_init": ([], _int), "flock_cpu_tiles": ([], _int),
                "flock_cpu_cascade": ([ctypes.POINTER(_Args)], _int),
                "flock_cpu_write_kv": ([_p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _i64], None),
                "flock_cpu_write_kv_fp8": ([_p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _i32, _i32, _i32, _i32], None),
                "flock_cpu_write_kv_fp8_op": ([_p], ctypes.c_int32),
                "flock_cpu_unit_rows": ([], _int), "flock_cpu_chunk": ([], _int),
                "flock_cpu_plan": ([_p, _p, _p, _p, _i64, _p, _p, _p, _p, _p, _p, _p, _p, _p], _int),
                "flock_cpu_write_kv_op": ([_p], ctypes.c_int32), "flock_cpu_cascade_op": ([_p], ctypes.c_int32)})
PATHS = KERNEL.paths
EMULATED_AMX, EMULATED_AMX_512 = "avx2-emulated-amx", "avx512bf16-emulated-amx"
# each emulated path's build and the ISA path it is built for
_EMULATED = {name: (replace(KERNEL, flags=(*KERNEL.flags, "-DFLOCK_EMULATED_AMX"), paths=(base,)), base)
             for name, base in ((EMULATED_AMX, "avx2"), (EMULATED_AMX_512, "avx512bf16"))}


def forced_isa() -> str | None:
    """FLOCK_CPU_ISA, checked: the path to force, or None."""
    return native.forced_isa(PATHS)


def isa_paths() -> list[str]:
    """The kernel paths this CPU runs, best first."""
    return KERNEL.runnable()


def chosen_isa() -> str | None:
    """The path the kernel takes here: the forced one, else the best the CPU runs whose build loads (AMX needs
    Linux's permission); None if none."""
    forced = forced_isa()
    if forced is None:
        return KERNEL.best()
    return forced if forced in isa_paths() else None


def _library(isa: str) -> tuple[native.Library, str]:
    return _EMULATED.get(isa, (KERNEL, isa))


def kernel_library(isa: str) -> ctypes.CDLL:
    """The kernel's library of path `isa` (or an emulated AMX one), loaded."""
    library, path = _library(isa)
    return library.load(path)


def kernel_unavailable(isa: str | None = None) -> str | None:
    """Why the fused CPU kernel cannot run here on path `isa` (default: the chosen one), or None when it can."""
    if isa is not None:
        library, path = _library(isa)
        return library.unavailable(path)
    path = chosen_isa()
    if path is None:
        forced = forced_isa()
        missing = native.missing_flags(forced) if forced in PATHS else []
        return (f"{native.ISA_ENV}={forced} but this CPU lacks {', '.join(missing)}" if missing
                else "this CPU has no AVX2 + FMA (nor AVX-512)")
    return KERNEL.unavailable(path)


@dataclass
class CpuMetadata(AttentionMetadata):
    segs: torch.Tensor  # [S, 7] int32: begin, rows, table, kv_start, kv_end, causal, slot (-1: output)
    tokens: torch.Tensor  # int32 step index of every entry
    positions: torch.Tensor  # int32 position of every entry
    tables: torch.Tensor  # int32 block tables, concatenated
    merge_offsets: torch.Tensor  # int32 [M + 1]: token m's partial slots are merge_slots[offsets[m]:offsets[m + 1]]
    merge_slots: torch.Tensor
    merge_tokens: torch.Tensor  # int32 [M] step index of each merged token
    num_slots: int
    block_size: int
    attend_ends: torch.Tensor | None = None  # int32 per entry: Segments.attend_ends (None: causal order)


def plan_segments(s: Segments, heads_per_kv: int, num_kv_heads: int, threads: int, unit_rows: int, chunk: int):
    """The kernel's segment table, with every segment whose one-KV-head unit would hold more than half a
    thread's share of the work split by KV range (pieces of whole chunks, each its own partial slots), and the
    partial slots of each token to merge. Partials of unsplit grouped segments sit at their entries' index."""
    causal = (s.kind != PREFIX).astype(np.int64)
    slot = np.where(s.kind == DIRECT, -1, s.begin)
    kv_len = s.kv_end - s.kv_start
    share = float((s.rows * kv_len).sum()) * num_kv_heads / max(threads, 1)
    unit = np.minimum(s.rows, unit_rows) * kv_len
    parts = np.ones(len(s), dtype=np.int64)
    if threads > 1 and share > 0:
        parts = np.clip(np.ceil(unit / (share / 2)), 1, np.minimum(MAX_PARTS, -(-kv_len // chunk))).astype(np.int64)
    step = -(-kv_len // np.maximum(parts, 1) // chunk) * chunk
    parts = np.where(kv_len > 0, -(-kv_len // np.maximum(step, 1)), 1)
    piece = np.repeat(np.arange(len(s)), parts)
    index = np.arange(len(piece)) - np.repeat(np.cumsum(parts) - parts, parts)  # piece number in its segment
    kv_start = s.kv_start[piece] + index * step[piece]
    kv_end = np.minimum(kv_start + step[piece], s.kv_end[piece])
    tokens_of = s.rows // heads_per_kv
    fresh = (index > 0) | (slot[piece] < 0) & (parts[piece] > 1)  # pieces that need slots of their own
    base = 2 * s.num_partial
    sizes = np.where(fresh, tokens_of[piece], 0)
    new_slot = base + np.cumsum(sizes) - sizes
    piece_slot = np.where(fresh, new_slot, slot[piece])
    num_slots = base + int(sizes.sum())
    segs = np.stack([s.begin[piece], s.rows[piece], s.table[piece], kv_start, kv_end, causal[piece], piece_slot], 1)
    slot_token = np.concatenate([s.tokens[:base], s.tokens[concat_ranges(s.begin[piece][fresh], sizes[fresh])]])
    order = np.argsort(slot_token, kind="stable")
    starts = np.flatnonzero(np.diff(slot_token[order], prepend=-1)) if num_slots else np.zeros(0, dtype=np.int64)
    offsets = np.append(starts, num_slots)
    return segs, order, offsets, slot_token[order][starts], num_slots


class CpuCascadeBackend(TorchCascadeBackend):
    name = "cpu"

    def __init__(self, *args, isa: str | None = None, **kwargs):
        """`isa`: a path of PATHS (or an emulated AMX one) to take, if this CPU runs it; default: chosen_isa()."""
        super().__init__(*args, **kwargs)
        runs = isa is not None and _library(isa)[1] in isa_paths()
        self.isa = chosen_isa() if isa is None else isa if runs else None
        self.partials = PartialBuffers(self.num_heads, self.head_dim)

    def uses_kernel(self, device: torch.device) -> bool:
        return device.type == "cpu" and self._kernel_runs

    @functools.cached_property
    def _kernel_runs(self) -> bool:
        """Whether the kernel takes this backend's shapes and its ISA path runs here (asked once: each step asks)."""
        return (self.dtype in (torch.bfloat16, torch.float32) and self.head_dim % 16 == 0 and self.head_dim <= 256
                and self.isa is not None and kernel_unavailable(self.isa) is None)

    def build_metadata(self, layout: StepLayout):
        if not self.uses_kernel(layout.slot_mapping.device):
            return super().build_metadata(layout)
        meta = self._plan(layout, layout.slot_mapping)
        if layout.sampled is not None and layout.num_sample_rows < len(layout.slot_mapping):
            sampled, rows = layout.sampled_only()
            meta.rows_only = self._plan(sampled, layout.slot_mapping, rows)
        return meta

    def _plan(self, layout: StepLayout, slot_mapping: torch.Tensor, tokens: np.ndarray | None = None) -> CpuMetadata:
        """The kernel's work for `layout`'s queries; `tokens`: their indices in the step (default: themselves).
        Planned in C (flock_cpu_plan) unless a window, image spans or `tokens` need the numpy planner's."""
        lib = kernel_library(self.isa)
        g = self.num_heads // self.num_kv_heads
        if tokens is None and self.sliding_window is None and layout.attend_ends is None and len(layout.seq_lens):
            return self._plan_in_c(lib, layout, slot_mapping, g)
        s = build_segments(layout, g, self.min_prefix_blocks, MAX_GROUP_QUERY, self.sliding_window)
        if tokens is not None:
            s.tokens = tokens[s.tokens]
        segs, slots, offsets, merged, num_slots = plan_segments(
            s, g, self.num_kv_heads, torch.get_num_threads(), lib.flock_cpu_unit_rows(), lib.flock_cpu_chunk())
        return CpuMetadata(slot_mapping, int32(segs), int32(s.tokens), int32(s.positions), int32(s.tables),
                           int32(offsets), int32(slots), int32(merged), num_slots, layout.block_size,
                           None if s.attend_ends is None else int32(s.attend_ends))

    def _plan_in_c(self, lib: ctypes.CDLL, layout: StepLayout, slot_mapping: torch.Tensor, g: int) -> CpuMetadata:
        """_plan's arrays by flock_cpu_plan: build_segments' and plan_segments' (the same values), in one call."""
        query_start = np.ascontiguousarray(layout.query_start, dtype=np.int64)
        seq_lens = np.ascontiguousarray(layout.seq_lens, dtype=np.int64)
        table_lens = np.fromiter(map(len, layout.block_tables), np.int64, len(layout.block_tables))
        tables = np.ascontiguousarray(np.concatenate(layout.block_tables), dtype=np.int64)
        config = np.array([layout.block_size, g, self.min_prefix_blocks, MAX_GROUP_QUERY, self.num_kv_heads,
                           torch.get_num_threads(), lib.flock_cpu_unit_rows(), lib.flock_cpu_chunk(), MAX_PARTS],
                          dtype=np.int64)
        # at most: a segment per request and per group of two; entries, the grouped ones twice; slots, those two
        # copies and each piece's own
        num_tokens = int(query_start[-1])
        pieces, entries, slots = 2 * len(seq_lens) * MAX_PARTS, 2 * num_tokens, 2 * num_tokens * (1 + MAX_PARTS)
        segs, tables32, sizes = np.empty((pieces, 7), np.int32), np.empty(len(tables), np.int32), np.zeros(4, np.int64)
        tokens, positions = np.empty(entries, np.int32), np.empty(entries, np.int32)
        offsets = np.empty(slots + 1, np.int32)
        merge_slots, merged = np.empty(slots, np.int32), np.empty(slots, np.int32)
        if lib.flock_cpu_plan(*(a.ctypes.data for a in (query_start, seq_lens, table_lens, tables)), len(seq_lens),
                              *(a.ctypes.data for a in (config, segs, tokens, positions, tables32, offsets, merge_slots,
                                                        merged, sizes))):
            raise MemoryError("the CPU attention plan ran out of memory")
        pieces, entries, slots, num_merged = sizes.tolist()
        return CpuMetadata(slot_mapping, *(torch.from_numpy(a) for a in (
            segs[:pieces], tokens[:entries], positions[:entries], tables32, offsets[: num_merged + 1],
            merge_slots[:slots], merged[:num_merged])), slots, layout.block_size)

    def forward(self, q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
        if not isinstance(meta, CpuMetadata):
            return super().forward(q, k, v, k_cache, v_cache, meta)
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError("the CPU attention kernel needs K and V caches of one layout with contiguous heads")
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype)
        args = self.kernel_args(q, k_cache, v_cache, out, meta)
        code = kernel_library(self.isa).flock_cpu_cascade(ctypes.byref(args))
        if code != 0:
            raise RuntimeError(f"CPU cascade kernel ({self.isa}) failed ({code})")
        return out

    def kernel_args(self, q, k_cache, v_cache, out, meta: CpuMetadata | None = None) -> _Args:
        """The kernel's arguments: attention of q [T, heads, head_dim] (heads contiguous) into out, as `meta`
        plans it (None: plan_args sets the plan's later)."""
        args = _Args(
            q=q.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), q_stride_t=q.stride(0),
            q_stride_h=q.stride(1), kv_stride_b=k_cache.stride(0), kv_stride_s=k_cache.stride(1),
            kv_stride_h=k_cache.stride(2), out=out.data_ptr(), out_stride_t=out.stride(0), out_stride_h=out.stride(1),
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, scale=self.scale,
            bf16=int(q.dtype == torch.bfloat16), window=self.sliding_window or 0, softcap=self.softcap or 0.0,
            kv_format=KV_FORMATS.get(k_cache.dtype, 0), direct_rows=direct_rows())
        if meta is not None:
            self.plan_args(args, meta)
        return args

    def plan_args(self, args: _Args, meta: CpuMetadata) -> None:
        """The fields of the kernel's arguments that a step's plan gives."""
        o_part, lse_part = self.partials.get(meta.num_slots)
        args.segs, args.tokens, args.positions, args.tables = (
            meta.segs.data_ptr(), meta.tokens.data_ptr(), meta.positions.data_ptr(), meta.tables.data_ptr())
        args.merge_offsets, args.merge_slots, args.merge_tokens = (
            meta.merge_offsets.data_ptr(), meta.merge_slots.data_ptr(), meta.merge_tokens.data_ptr())
        args.num_segs, args.num_merges, args.block_size = len(meta.segs), len(meta.merge_tokens), meta.block_size
        args.o_part, args.lse_part = o_part.data_ptr(), lse_part.data_ptr()
        args.attend_ends = None if meta.attend_ends is None else meta.attend_ends.data_ptr()

    def _write_kv(self, k, v, k_cache, v_cache, slots: torch.Tensor) -> None:
        """write_kv by one memcpy per token and cache where each token's heads are contiguous rows (quantized
        row by row in C for an fp8 cache)."""
        heads, dim = k.shape[1:]
        kv_format = KV_FORMATS.get(k_cache.dtype, 0)
        rows_ok = k.stride()[1:] == v.stride()[1:] == (dim, 1) and k.dtype == v.dtype
        if not (rows_ok and (kv_format or k_cache.dtype == k.dtype) and k_cache.is_contiguous()
                and k_cache.shape[2:] == (heads, fp8.row_width(dim, k_cache.dtype))
                and slots.dtype == torch.int64 and slots.is_contiguous() and len(slots) == len(k)):
            return write_kv(k, v, k_cache, v_cache, slots)
        size, lib = k.element_size(), kernel_library(self.isa)
        slot_bytes = k_cache.stride(1) * k_cache.element_size()
        if kv_format:
            lib.flock_cpu_write_kv_fp8(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size,
                                       k_cache.data_ptr(), v_cache.data_ptr(), slot_bytes, slots.data_ptr(), k.shape[0],
                                       heads, dim, int(k.dtype == torch.bfloat16), kv_format)
            return
        lib.flock_cpu_write_kv(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size, k_cache.data_ptr(),
                               v_cache.data_ptr(), slot_bytes, slots.data_ptr(), k.shape[0], heads * dim * size)
