"""Weights kept in GGUF's quantized blocks (as llama.cpp stores them) and the int8 GEMMs on them
(`csrc/quant_gemm.c`).

A `QuantWeight` holds a layer's weight as the file's bytes: one `QuantTensor` per quant type, stacked on rows
(a fused qkv whose v part is Q6_K and q, k Q4_K). `linear` quantizes the activations per row to int8 (blocks of
32, or super-blocks of 256 for the K-quants and IQ4_XS, as llama.cpp does) and multiplies them by the blocks in integer
dot products; `dequantize_rows` looks embedding rows up. `for_kernels` interleaves the rows 8 at a time for the
kernels' 8-row layout (as llama.cpp repacks them). `quantize` makes Q8_0 / Q4_0 blocks from float weights with
the gguf package's quantizer, for models that come as floats. The kernels are built for AMX-INT8 (tiles for
calls of 3+ rows on interleaved weights, the same bits as the vector kernels), VNNI (AVX512-VNNI or AVX-VNNI),
AVX2 and the baseline (portable C: the reference path); `isa()` says which one runs.
"""

import ctypes
import functools
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from flock import native
from flock.model import gemm, huge_pages, iq_grids

# ggml's quant types the kernels take: name -> (type id, values per block, bytes per block)
KERNEL_TYPES = {"Q8_0": (8, 32, 34), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
                "Q5_1": (7, 32, 24), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
                "IQ4_XS": (23, 256, 136), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110),
                # IQ4_XS's or Q3_K's blocks with a lattice type's table of values (flock.model.iq_grids), Flock's
                # own ids
                "IQ3_S@IQ4_XS": (121, 256, 136), "IQ3_XXS@IQ4_XS": (118, 256, 136), "IQ2_XXS@IQ4_XS": (116, 256, 136),
                "IQ1_S@IQ4_XS": (119, 256, 136), "IQ2_XS@Q3_K": (117, 256, 110), "IQ2_S@Q3_K": (122, 256, 110),
                "IQ1_M@Q3_K": (129, 256, 110)}
TYPE_NAMES = {spec[0]: name for name, spec in KERNEL_TYPES.items()}
# types the kernels take once their blocks are rewritten as a kernel type's of the same values (`transcode`): their
# id, values and bytes a block, and that type
TRANSCODED = {"IQ4_NL": (20, 32, 18, "Q8_0"),
              **{name.split("@")[0]: (spec[0] - 100, 256, iq_grids.TYPES[spec[0] - 100][0], name)
                 for name, spec in KERNEL_TYPES.items() if "@" in name}}
BLOCK_TYPES = {spec[0] for spec in (*KERNEL_TYPES.values(), *TRANSCODED.values())}  # the ids kept as blocks
LOAD_TYPES = ("q8_0", "q4_0")  # what EngineConfig.quantization can quantize float weights to
ACT_BYTES = {32: 40, 256: 308}  # an activation block: its scale (and sums) and int8 values
# a row's share of 8 rows' interleaved blocks (every kernel type has the layout)
X8_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 148, "Q5_K": 180, "Q6_K": 210,
            "IQ4_XS": 138, "Q2_K": 84, "Q3_K": 114,
            **{name: 138 if name.endswith("@IQ4_XS") else 114 for name in KERNEL_TYPES if "@" in name}}

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


def _ready(lib: ctypes.CDLL) -> str | None:
    """None where the build may run: on AMX builds, Linux grants the tile state and 16 rows on the tiles give
    the bits of each row alone (the vector kernels)."""
    if lib.flock_qgemm_init() != 0:
        return native.AMX_REFUSED
    if lib.flock_qgemm_level() < 3:
        return None
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((16, 256), dtype=np.float32))
    checks = (("Q4_K", (0, 2)), ("Q6_K", (208,)), ("Q8_0", (0,)), ("IQ4_XS", (0,)), ("Q2_K", (80, 82)),
              ("Q3_K", (108,)))
    for name, d_at in checks:  # random blocks, small scales
        qtype, values, size = KERNEL_TYPES[name]
        blocks = rng.integers(0, 256, (16, 256 // values, size), dtype=np.uint8)
        for at in d_at:
            blocks[:, :, at:at + 2] = np.full((16, 256 // values, 1), 0.01, dtype=np.float16).view(np.uint8)
        rows = torch.from_numpy(blocks.reshape(16, -1))
        x8 = torch.empty(16, 256 // values * X8_BYTES[name], dtype=torch.uint8)
        lib.flock_interleave(qtype, rows.data_ptr(), rows.shape[1], 16, 256, x8.data_ptr(), 1)
        tiles, alone = torch.empty(16, 16), torch.empty(16, 16)
        code = lib.flock_qgemm(qtype, 1, x8.data_ptr(), x8.shape[1], 16, 256, x.data_ptr(), 256, 0, 16,
                               tiles.data_ptr(), 16, 0, 0, 1)
        for r in range(16):
            lib.flock_qgemm(qtype, 1, x8.data_ptr(), x8.shape[1], 16, 256, x[r].data_ptr(), 256, 0, 1,
                            alone[r].data_ptr(), 16, 0, 0, 1)
        if code or not torch.equal(tiles, alone):
            return f"the AMX-INT8 tiles disagree with the vector kernels here ({name}, {code})"
    return None


KERNEL = native.Library(
    Path(__file__).resolve().parent / "csrc" / "quant_gemm.c", "the quantized GEMM ({path})",
    paths=("amxint8", "avx512vnni", "avxvnni", "avx2", "baseline"), flags=("-O3", "-fopenmp", "-fno-math-errno"),
    ready=_ready,
    signatures={"flock_qgemm": ([_i32, _i32, _ptr, _i64, _i64, _i64, _ptr, _i64, _i32, _i64, _ptr, _i64, _i32, _i32,
                                 _i32], _i32),
                "flock_interleave": ([_i32, _ptr, _i64, _i64, _i64, _ptr, _i32], None),
                "flock_transcode": ([_i32, _ptr, _i64, _ptr, _i32], None),
                "flock_table_values": ([_i32, _ptr], None),
                "flock_quantize_rows": ([_ptr, _i64, _i32, _i64, _i64, _i32, _ptr, _i32], None),
                "flock_dequantize_rows": ([_i32, _i32, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i32, _i32], None),
                "flock_qdot_scalar": ([_i32, _ptr, _ptr, _i64, _ptr], None),
                "flock_qmoe": gemm.MOE_SIGNATURE, "flock_qmoe_op": ([_ptr], _i32),
                "flock_qgemm_level": ([], _i32), "flock_qgemm_op": ([_ptr], _i32), "flock_qgemm_init": ([], _i32)})
# The VNNI kernels built for AVX2 with vpdpbusd emulated exactly (path EMULATED_VNNI), and the AMX tiles built
# for AVX2 with the tile operations in portable C (EMULATED_AMX): how CPUs without VNNI or AMX test them. Built for
# AVX512-VNNI (EMULATED_AMX_512), the tiles' unpacking and float steps are the amxint8 build's AVX-512 code.
EMULATED_VNNI, EMULATED_AMX, EMULATED_AMX_512 = "avx2-emulated-vnni", "avx2-emulated-amx", "avx512vnni-emulated-amx"
_EMULATED = {name: (replace(KERNEL, flags=(*KERNEL.flags, flag), paths=(base,)), base)
             for name, flag, base in ((EMULATED_VNNI, "-DFLOCK_EMULATED_VNNI", "avx2"),
                                      (EMULATED_AMX, "-DFLOCK_EMULATED_AMX", "avx2"),
                                      (EMULATED_AMX_512, "-DFLOCK_EMULATED_AMX", "avx512vnni"))}


@functools.cache
def isa() -> str:
    """The ISA path the kernels run here (amxint8, avx512vnni, avxvnni, avx2, else baseline): the best this CPU
    has whose build loads. The amxint8 build runs calls of 3+ rows on the tiles and fewer on AVX512-VNNI."""
    return KERNEL.best()


AMX_DEQUANTIZE_BYTES = 1 << 30  # bf16 weights up to this size run faster dequantized on AMX CPUs


def blocks_lose(dtype: torch.dtype, float_bytes: int) -> str | None:
    """Why quantization "auto" dequantizes a model whose weights take `float_bytes` in `dtype` where the int8
    kernels could run (None: it keeps the blocks). On AMX CPUs the bf16 GEMM runs steps of 8 or more rows
    faster than the int8 kernels (docs/benchmarks.md); single-row decode, bound by the bytes read, is faster on
    the blocks, so only models small beside the memory are dequantized."""
    if dtype != torch.bfloat16 or gemm.isa() != "amx" or float_bytes > AMX_DEQUANTIZE_BYTES:
        return None
    return f"{float_bytes / 2**20:.0f} MiB as bf16: Flock's AMX GEMM runs batches faster than the int8 kernels"


def unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why quantized weights cannot serve a model of this dtype on this device, or None when they can."""
    if device.type != "cpu":
        return f"the quantized GEMM is a CPU path, not {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the quantized GEMM takes float32 and bfloat16 activations, not {dtype}"
    return KERNEL.unavailable(isa())


def _lib(path: str | None):
    if path in _EMULATED:
        library, base = _EMULATED[path]
        return library.load(base)
    return KERNEL.load(path or isa())


@dataclass
class QuantTensor:
    """`rows` rows of k values in one quant type: `blocks` uint8 [rows, k / block * block bytes], or with
    `interleaved` each 8 rows' super-blocks side by side (`interleave`)."""

    qtype: int  # ggml's type id
    blocks: torch.Tensor
    interleaved: bool = False

    @property
    def name(self) -> str:
        return TYPE_NAMES[self.qtype]

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    @property
    def k(self) -> int:
        _, values, size = KERNEL_TYPES[self.name]
        return self.blocks.shape[1] // (X8_BYTES[self.name] if self.interleaved else size) * values

    @property
    def act_block(self) -> int:
        return KERNEL_TYPES[self.name][1]


@dataclass
class QuantWeight:
    """An [n, k] weight as quantized tensors stacked on rows; adjacent parts of one type are merged. `order`: the
    input each column takes, where an act-order checkpoint's columns are sorted by group (flock.model.hf_quant)."""

    parts: list[QuantTensor]
    order: torch.Tensor | None = None

    def __post_init__(self):
        merged = [self.parts[0]]
        for part in self.parts[1:]:
            if (part.qtype, part.interleaved) == (merged[-1].qtype, merged[-1].interleaved):
                merged[-1] = QuantTensor(part.qtype, torch.cat([merged[-1].blocks, part.blocks]), part.interleaved)
            else:
                merged.append(part)
        self.parts = merged
        if len({p.k for p in merged}) != 1:
            raise ValueError(f"quantized parts of different widths: {[p.k for p in merged]}")

    @functools.cached_property
    def n(self) -> int:
        return sum(p.rows for p in self.parts)

    @functools.cached_property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def nbytes(self) -> int:
        return sum(p.blocks.numel() for p in self.parts)

    @functools.cached_property
    def calls(self) -> dict[bool, list[tuple[int, bool, torch.Tensor, int, int, int]]]:
        """flock_qgemm's arguments of each part, without and with glu: type, interleaved, blocks, row bytes,
        outputs, first output (worked out once: a decode step makes ~65 calls)."""
        calls = {}
        for glu in (False, True):
            calls[glu], col = [], 0
            for part in self.parts:
                cols = part.rows // 2 if glu else part.rows
                calls[glu].append((part.qtype, part.interleaved, part.blocks, part.blocks.shape[1], cols, col))
                col += cols
        return calls

    @property
    def types(self) -> str:
        return "+".join(p.name for p in self.parts)


def interleave(tensor: QuantTensor, path: str | None = None) -> QuantTensor:
    """The rows, 8 at a time, as the interleaved blocks the 8-row kernels read; a row count that is not a multiple
    of 8 as it is."""
    if tensor.interleaved or tensor.rows % 8:
        return tensor
    out = huge_pages.empty((tensor.rows, tensor.k // tensor.act_block * X8_BYTES[tensor.name]), torch.uint8)
    _lib(path).flock_interleave(tensor.qtype, tensor.blocks.data_ptr(), tensor.blocks.stride(0), tensor.rows, tensor.k,
                                out.data_ptr(), torch.get_num_threads())
    return QuantTensor(tensor.qtype, out, interleaved=True)


def table_values(qtype: int) -> np.ndarray:
    """The 16 int8 values the 4-bit indices of IQ4_XS's blocks of this type pick from (Q3_K's 3-bit indices: the
    first 8)."""
    out = np.empty(16, np.int8)
    _lib(None).flock_table_values(qtype, out.ctypes.data)
    return out


def transcode(qtype: int, blocks: torch.Tensor) -> QuantTensor:
    """Rows of blocks of a kernel type as they are; of a TRANSCODED type as the blocks of its kernel type that hold
    the same values (IQ4_NL as Q8_0; the lattice IQ types as IQ4_XS's or Q3_K's blocks with their own table of
    values, flock.model.iq_grids), whose integer products are the same."""
    name = next((n for n, spec in TRANSCODED.items() if spec[0] == qtype), None)
    if name is None:
        return QuantTensor(qtype, blocks)
    _, _, size, target = TRANSCODED[name]
    if qtype in iq_grids.TYPES:
        target_id = KERNEL_TYPES[target][0]
        rewritten = iq_grids.rewrite(qtype, blocks.numpy(), table_values(target_id))
        return QuantTensor(target_id, torch.from_numpy(rewritten))
    blocks = blocks.contiguous()
    out = torch.empty(blocks.shape[0], blocks.shape[1] // size * KERNEL_TYPES[target][2], dtype=torch.uint8)
    _lib(None).flock_transcode(qtype, blocks.data_ptr(), blocks.numel() // size, out.data_ptr(),
                               torch.get_num_threads())
    return QuantTensor(KERNEL_TYPES[target][0], out)


def for_kernels(tensor: QuantTensor) -> QuantTensor:
    """The tensor in the layout the kernels here read fastest: interleaved on every path but the baseline."""
    return interleave(tensor) if interleaves(tensor.rows) else tensor


def interleaves(rows: int) -> bool:
    """Whether `for_kernels` interleaves a tensor of this many rows."""
    return rows % 8 == 0 and isa() != "baseline"


def quantize(weight: torch.Tensor, kind: str) -> QuantTensor:
    """Float [n, k] weights (k a multiple of 32) as Q8_0 or Q4_0 blocks, by the gguf package's quantizer."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind.upper()]
    blocks = quants.quantize(weight.detach().float().numpy(), qtype)
    return QuantTensor(int(qtype), torch.from_numpy(np.ascontiguousarray(blocks)))


def quantize_activations(rows: torch.Tensor, qtype: int, path: str | None = None) -> torch.Tensor:
    """The int8 activation blocks of float32/bf16 rows [m, k] that weights of GGML type `qtype` meet, as
    flock_qgemm makes them inside its call (for the scalar reference dot product, flock_qdot_scalar)."""
    m, k = rows.shape
    block = KERNEL_TYPES[TYPE_NAMES[qtype]][1]
    out = torch.empty(m * (k // block) * ACT_BYTES[block], dtype=torch.uint8)
    _lib(path).flock_quantize_rows(rows.data_ptr(), rows.stride(0), int(rows.dtype == torch.bfloat16), m, k, qtype,
                                   out.data_ptr(), torch.get_num_threads())
    return out


def fuses_glu(weight: QuantWeight) -> bool:
    """Whether `linear(glu=True)` takes this [gate | up] weight: one part, whose octets of interleaved rows do not
    straddle gate and up."""
    return len(weight.parts) == 1 and not (weight.parts[0].interleaved and weight.n // 2 % 8)


def linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None,
           glu: bool = False, path: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias), x: float32 or bf16 [..., k]; out in `dtype` (default x's). `glu` (one part of 2I rows
    [gate | up]): silu(gate) * up, I outputs. `out`: where to write x's rows (contiguous [rows, outputs])."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the quantized GEMM takes float32 or bfloat16 activations, not {x.dtype}")
    if glu and not fuses_glu(weight):
        raise ValueError(f"glu needs gate and up in one quant type ({weight.types}), interleaved only where each "
                         f"is a multiple of 8 rows ({weight.n} rows)")
    dtype = dtype or x.dtype
    flat = x.dim() == 2  # the model's rows: no reshape and view back (each costs a few us of ~65 calls a step)
    if x.shape[-1] != weight.k:
        raise ValueError(f"activations of width {x.shape[-1]} for a weight of width {weight.k}")
    rows = x if flat else x.reshape(-1, weight.k)
    if weight.order is not None:
        rows = rows.index_select(1, weight.order)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = weight.n // 2 if glu else weight.n
    m = rows.shape[0]
    out = gemm.output(out, m, n, dtype)
    if m:
        lib, threads, out_at, x_at = _lib(path), torch.get_num_threads(), out.data_ptr(), rows.data_ptr()
        ldx, x_bf16, out_bf16 = rows.stride(0), rows.dtype == torch.bfloat16, dtype == torch.bfloat16
        for qtype, x8, blocks, row_bytes, cols, col in weight.calls[glu]:
            code = lib.flock_qgemm(qtype, x8, blocks.data_ptr(), row_bytes, cols, weight.k, x_at, ldx, x_bf16, m,
                                   out_at + col * out.element_size(), n, out_bf16, glu, threads)
            if code == -1:
                raise MemoryError(f"no memory for the int8 activations of {m} rows (or the AMX tiles' scratch)")
            if code:
                raise RuntimeError(f"the quantized GEMM's tiles met shapes an AMX CPU refuses ({code})")
    if bias is not None:
        out += bias
    return out if flat else out.view(*x.shape[:-1], n)


def _part_rows(part: QuantTensor, ids: torch.Tensor, k: int, dtype: torch.dtype, path: str | None) -> torch.Tensor:
    """Rows `ids` (int64, contiguous, inside the part) of one part as `dtype` (float32 or bf16)."""
    got = torch.empty((ids.numel(), k), dtype=dtype)
    _lib(path).flock_dequantize_rows(part.qtype, int(part.interleaved), part.blocks.data_ptr(), part.blocks.shape[1],
                                     ids.data_ptr(), ids.numel(), k, got.data_ptr(), int(dtype == torch.bfloat16),
                                     torch.get_num_threads())
    return got


def dequantize_rows(weight: QuantWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32,
                    path: str | None = None) -> torch.Tensor:
    """Rows `ids` of the weight as floats (float32, or bf16); an embedding lookup."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    kind = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    if len(weight.parts) == 1 and flat.numel() and 0 <= int(flat.min()) and int(flat.max()) < weight.n:
        out = _part_rows(weight.parts[0], flat, weight.k, kind, path)  # an embedding's lookup: no masks
    else:
        out, start = torch.empty((flat.numel(), weight.k), dtype=kind), 0
        for part in weight.parts:
            mine = (flat >= start) & (flat < start + part.rows)
            out[mine] = _part_rows(part, (flat[mine] - start).contiguous(), weight.k, kind, path)
            start += part.rows
    return out.to(dtype).view(*ids.shape, weight.k)


def dequantize(weight: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole [n, k] weight as floats, its columns in the inputs' order."""
    values = dequantize_rows(weight, torch.arange(weight.n), dtype)
    return values if weight.order is None else values[:, torch.argsort(weight.order)]
