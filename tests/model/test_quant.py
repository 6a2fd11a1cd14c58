"""The quantized GEMM (flock.model.quant) against float64 references on the gguf package's dequantized weights,
for every quant type the kernels take, on every ISA path this CPU runs (the baseline included)."""

import gguf
import numpy as np
import pytest
import torch

from flock.model import iq_grids, quant
from flock.model.quant import KERNEL_TYPES, QuantTensor, QuantWeight
from tests.model import gguf_files

TYPES = list(KERNEL_TYPES)
RUNNABLE = quant.KERNEL.runnable()
# the VNNI kernels run everywhere AVX2 does, natively or with vpdpbusd emulated; the AMX tiles (calls of 16+
# rows) too, with the tile operations emulated (TILE_PATHS: they give the AVX2 kernel's bits), their AVX-512 steps
# on AVX512-VNNI CPUs
PATHS = RUNNABLE + [quant.EMULATED_VNNI] * ("avx2" in RUNNABLE)
LEVELS = {"amxint8": 3, quant.EMULATED_AMX: 3, quant.EMULATED_AMX_512: 3, "avx512vnni": 2, "avxvnni": 2,
          quant.EMULATED_VNNI: 2, "avx2": 1, "baseline": 0}
TILE_PATHS = ([p for p in RUNNABLE if LEVELS[p] == 3] + [quant.EMULATED_AMX] * ("avx2" in RUNNABLE)
              + [quant.EMULATED_AMX_512] * ("avx512vnni" in RUNNABLE))
# every type in its file's row layout, and the types the 8-row kernels also take interleaved
LAYOUTS = [(name, False) for name in TYPES] + [(name, True) for name in quant.X8_BYTES]


def random_blocks(name: str, rows: int, k: int, seed: int = 0, interleaved: bool = False) -> QuantTensor:
    """Random blocks of a kernel type; of a lattice IQ type's table type, that type's random blocks rewritten as
    at load."""
    qtype = gguf.GGMLQuantizationType[name.split("@")[0]]
    t = quant.transcode(int(qtype), torch.from_numpy(gguf_files.random_blocks(qtype, rows, k, 0.02, seed)))
    if interleaved:
        x8 = quant.interleave(t)
        assert x8.interleaved and x8.k == k and x8.rows == rows
        return x8
    return t


def reference(t: QuantTensor) -> np.ndarray:
    assert not t.interleaved
    if "@" in t.name:  # d times 1 / m
        m = iq_grids.TYPES[t.qtype - 100][1]
        layout_values = gguf_files.iq4_xs_layout_values if t.name.endswith("IQ4_XS") else gguf_files.q3_k_layout_values
        return layout_values(t.blocks.numpy(), quant.table_values(t.qtype)) / m
    return gguf.quants.dequantize(t.blocks.numpy(), gguf.GGMLQuantizationType(t.qtype)).astype(np.float64)


def quantized_rows(x: np.ndarray, block: int) -> np.ndarray:
    """The activations as the kernels see them: int8 per block of `block`, scale max|x| / 127 (a 32-block's
    scale then rounded to fp16, as llama.cpp's Q8_0 stores it)."""
    b = x.reshape(x.shape[0], -1, block)
    d = (np.abs(b).max(-1, keepdims=True) / 127).astype(np.float32)
    q = np.where(d > 0, np.round(b / np.where(d > 0, d, 1)), 0)
    return (q * (d.astype(np.float16) if block == 32 else d).astype(np.float64)).reshape(x.shape)


def minimum_sums_correction(x: np.ndarray, t: QuantTensor) -> np.ndarray:
    """Q4_1 / Q5_1: what the kernels' minimum term adds beyond `quantized_rows`: they take each block's minimum
    times its activations' scaled sum as llama.cpp's Q8_1 stores it, d * sum(q) rounded to fp16 itself."""
    if t.name not in ("Q4_1", "Q5_1"):
        return 0.0
    acts = quant.quantize_activations(torch.from_numpy(x), t.qtype).numpy().reshape(len(x), -1, 40)
    d, stored = (acts[:, :, at:at + 4].copy().view(np.float32)[..., 0].astype(np.float64) for at in (0, 4))
    exact = d * acts[:, :, 8:].view(np.int8).sum(-1)
    size = KERNEL_TYPES[t.name][2]
    minimums = t.blocks.numpy().reshape(t.rows, -1, size)[:, :, 2:4].copy().view(np.float16)[..., 0]
    return (stored - exact) @ minimums.astype(np.float64).T


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name, interleaved", LAYOUTS)
def test_dequantized_rows_equal_the_gguf_package(name, interleaved, path):
    rows = 40 if interleaved else 37
    t = random_blocks(name, rows, 512, interleaved=interleaved)
    ids = torch.tensor([[3, 0], [rows - 1, 3], [9, 14]])
    got = quant.dequantize_rows(QuantWeight([t]), ids, path=path)
    assert torch.equal(got, torch.from_numpy(reference(random_blocks(name, rows, 512))[ids.numpy()]).float())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name, interleaved", LAYOUTS)
@pytest.mark.parametrize("m", [1, 3, 4, 9, 17])
def test_gemm_equals_float64_on_the_kernels_activations(name, interleaved, path, m):
    """Bound 1: against x-as-quantized-by-the-kernel times the dequantized weight, only float32 rounding.
    Bound 2: against the float x, at most half an activation step per value times |w|."""
    n, k = (48 if interleaved else 45), 768
    t = random_blocks(name, n, k, seed=m)
    w = reference(t)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    weight = QuantWeight([quant.interleave(t) if interleaved else t])
    got = quant.linear(torch.from_numpy(x), weight, path=path).double().numpy()
    block = t.act_block
    xq = quantized_rows(x.astype(np.float64), block)
    scale = np.abs(xq) @ np.abs(w).T
    assert np.abs(got - xq @ w.T - minimum_sums_correction(x, t)).max() <= 2e-6 * scale.max()
    step = (np.abs(x).reshape(m, -1, block).max(-1) / 127 / 2).repeat(block, 1)
    assert (np.abs(got - x.astype(np.float64) @ w.T) <= step @ np.abs(w).T * 1.01 + 2e-6 * scale).all()


def test_each_path_runs_its_own_build():
    paths = PATHS + TILE_PATHS
    assert [quant._lib(p).flock_qgemm_level() for p in paths] == [LEVELS[p] for p in paths]
    assert quant.isa() == RUNNABLE[0]


def test_vnni_and_amx_paths_build_here():
    """The VNNI and AMX builds compile on any machine with gcc, whether or not its CPU runs them."""
    for path in ("amxint8", "avx512vnni", "avxvnni"):
        assert quant.KERNEL.build(path).exists()


@pytest.mark.skipif("avx2" not in RUNNABLE, reason="no AVX2 to compare with (and to build the tiles' emulation on)")
@pytest.mark.parametrize("path", TILE_PATHS)
@pytest.mark.parametrize("name", list(quant.X8_BYTES))
def test_amx_tiles_give_the_vector_kernels_bits(name, path):
    """3+ rows on interleaved weights take the tiles: every output the same bits as the AVX2 kernel's (so a
    step's row count never changes a row's result), over single and partial row tiles, a last group of 8 weight
    rows, three blocks, glu and bf16."""
    k = 768
    for m, n in ((3, 24), (12, 24), (16, 32), (21, 40), (40, 48), (300, 56)):
        weight = QuantWeight([random_blocks(name, n, k, m, interleaved=True)])
        x = torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]
        for rows, glu in ((x, False), (x.bfloat16(), False), (x, True)):
            if not glu or quant.fuses_glu(weight):
                assert torch.equal(quant.linear(rows, weight, glu=glu, path=path),
                                   quant.linear(rows, weight, glu=glu, path="avx2"))


VECTOR_PATHS = [p for p in PATHS if LEVELS[p] == 2]


@pytest.mark.skipif("avx2" not in RUNNABLE, reason="no AVX2 to compare with")
@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("name", list(quant.X8_BYTES))
def test_vnni_kernels_give_the_avx2_kernels_bits(name, path):
    """The VNNI kernels (on AVX-512 two octets at once where a tile holds both) sum the same products in the same
    order as AVX2's: every output the same bits, over 1-4 row tiles, partial ones, a last lone octet, glu and
    bf16."""
    k = 768
    for m, n in ((1, 16), (2, 24), (3, 40), (4, 48), (7, 56), (13, 64)):
        weight = QuantWeight([random_blocks(name, n, k, m, interleaved=True)])
        x = torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]
        for rows, glu in ((x, False), (x.bfloat16(), False), (x, True)):
            if not glu or quant.fuses_glu(weight):
                assert torch.equal(quant.linear(rows, weight, glu=glu, path=path),
                                   quant.linear(rows, weight, glu=glu, path="avx2"))


@pytest.mark.parametrize("name", TYPES)
def test_scalar_dot_equals_the_avx2_gemm(name):
    if "avx2" not in PATHS:
        pytest.skip("this CPU has no AVX2")
    t = random_blocks(name, 1, 1024, seed=5)
    x = torch.randn(1, 1024)
    acts = quant.quantize_activations(x, t.qtype)
    out = torch.empty(1)
    quant.KERNEL.load("baseline").flock_qdot_scalar(t.qtype, t.blocks.data_ptr(), acts.data_ptr(), 1024,
                                                    out.data_ptr())
    assert torch.allclose(quant.linear(x, QuantWeight([t]), path="avx2")[0], out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", sorted(set(PATHS) | set(TILE_PATHS)))
@pytest.mark.parametrize("name, interleaved", [("Q8_0", False), ("Q4_K", True), ("Q6_K", True), ("Q4_0", False)])
def test_a_nan_in_a_row_comes_out_nan_in_that_row_only(name, interleaved, path):
    """As the float product: every output of the row is NaN (its activations' scale is NaN), the other rows keep
    their bits; on the vector kernels (1-2 rows) and the tiles (3+)."""
    weight = QuantWeight([random_blocks(name, 32, 512, interleaved=interleaved)])
    for m in (1, 4, 20):
        x = torch.randn(m, 512)
        clean = quant.linear(x, weight, path=path)
        x[0, 7] = float("nan")
        got = quant.linear(x, weight, path=path)
        assert got[0].isnan().all() and torch.equal(got[1:], clean[1:])


@pytest.mark.parametrize("path", PATHS)
def test_the_quantized_gemm_writes_into_a_given_output(path):
    weight, x = QuantWeight([random_blocks("Q4_K", 48, 512, interleaved=True)]), torch.randn(5, 512)
    buffer = torch.full((7, 48), float("nan"))
    got = quant.linear(x, weight, path=path, out=buffer[:5])
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, quant.linear(x, weight, path=path))
    assert buffer[5:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_quantize_alike_on_every_path(dtype):
    x = (torch.randn(9, 512) * torch.rand(9, 1) * 4).to(dtype)
    x[2] = 0
    for qtype in (8, 3, 12):  # Q8_0, Q4_1 (its sums in fp16 too), Q4_K
        got = [quant.quantize_activations(x, qtype, path=p) for p in PATHS]
        assert all(torch.equal(g, got[-1]) for g in got)


@pytest.mark.parametrize("name", list(quant.TRANSCODED))
def test_transcoded_blocks_hold_the_files_values(name):
    """IQ4_NL / IQ3_S / IQ3_XXS / IQ2_XXS / IQ1_S blocks (every bit pattern but the scales random) rewritten as
    Q8_0 / IQ4_XS's blocks with their own values: the gguf package's values of the file's blocks, and Flock's of the
    rewritten ones, equal."""
    qtype = gguf.GGMLQuantizationType[name]
    blocks = gguf_files.random_blocks(qtype, 24, 1024, seed=3)
    t = quant.transcode(int(qtype), torch.from_numpy(blocks))
    assert t.name == quant.TRANSCODED[name][3] and t.k == 1024
    expected = gguf.quants.dequantize(blocks, qtype)
    np.testing.assert_array_equal(quant.dequantize(QuantWeight([t])).numpy(), expected)
    np.testing.assert_array_equal(reference(t), expected)
    kept = quant.transcode(t.qtype, t.blocks)  # a kernel type as it is
    assert kept.qtype == t.qtype and kept.blocks is t.blocks


@pytest.mark.parametrize("name", ["IQ3_XXS", "IQ2_XXS", "IQ1_S"])
def test_lattice_blocks_of_any_d_keep_their_values(name):
    """These types run with d times 1 / m in float32, so subnormal d's whose d / m no fp16 holds keep their values."""
    qtype = gguf.GGMLQuantizationType[name]
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = gguf_files.random_blocks(qtype, 2, 512, seed=4)
    blocks.reshape(-1, size)[:3, :2] = np.array([1, 9, 1023], np.uint16).view(np.uint8).reshape(3, 2)
    t = quant.transcode(int(qtype), torch.from_numpy(blocks))
    expected = gguf.quants.dequantize(blocks, qtype)
    np.testing.assert_array_equal(quant.dequantize(QuantWeight([t])).numpy(), expected)
    np.testing.assert_array_equal(reference(t), expected)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", [8, 3])  # Q8_0: d in fp16, s = d * sum(q); Q4_1 (Q8_1): s rounded to fp16 too
def test_activation_blocks_are_llama_cpps_q8_blocks(path, qtype):
    """Every 32-block bit for bit as the formula: d = max|x| / 127, q = round(x * (1 / d)) to even, both in
    float32, over the float range (zeros, ties, 1e-6 to 1e3) and row widths of 1 to 65 blocks."""
    for k in (32, 576, 2080):
        x = (torch.randn(6, k) * torch.logspace(-6, 3, 6).unsqueeze(1)).float()
        x[0, :32] = 0
        x[1, :32] = torch.arange(-15.5, 16.5)  # ties: d = 1 with the 127 below
        x[1, 0] = 127
        acts = quant.quantize_activations(x, qtype, path=path).numpy().reshape(6, k // 32, 40)
        b = x.numpy().reshape(6, k // 32, 32)
        d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)
        inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
        q = np.round(b * inverse[..., None]).astype(np.int8)
        stored_d, stored_s = (acts[..., at:at + 4].copy().view(np.float32)[..., 0] for at in (0, 4))
        np.testing.assert_array_equal(acts[..., 8:].view(np.int8), q)
        np.testing.assert_array_equal(stored_d, d.astype(np.float16).astype(np.float32))
        sums = q.astype(np.int32).sum(-1).astype(np.float32)
        s = (d * sums).astype(np.float16).astype(np.float32) if qtype == 3 else stored_d * sums
        np.testing.assert_array_equal(stored_s, s)


@pytest.mark.parametrize("path", PATHS)
def test_mixed_parts_glu_bias_and_bf16(path):
    k = 512
    q, v = random_blocks("Q4_K", 48, k, 1), random_blocks("Q6_K", 16, k, 2)
    weight = QuantWeight([q, random_blocks("Q4_K", 16, k, 3), v])
    assert weight.types == "Q4_K+Q6_K" and weight.n == 80
    x, bias = torch.randn(5, k), torch.randn(80)
    full = quant.linear(x, weight, bias, path=path)
    parts = [quant.linear(x, QuantWeight([p]), path=path) for p in weight.parts]
    assert torch.equal(full, torch.cat(parts, 1) + bias)
    gate_up = QuantWeight([random_blocks("Q8_0", 64, k, 4)])
    both = quant.linear(x, gate_up, path=path)
    glu = quant.linear(x, gate_up, glu=True, path=path)
    assert torch.allclose(glu, torch.nn.functional.silu(both[:, :32]) * both[:, 32:], rtol=1e-5, atol=1e-6)
    bf16 = quant.linear(x.bfloat16(), QuantWeight([q]), path=path)
    assert bf16.dtype == torch.bfloat16
    assert torch.allclose(bf16.float(), quant.linear(x.bfloat16().float(), QuantWeight([q]), path=path),
                          rtol=1e-2, atol=1e-2)
    assert quant.linear(x[:0], weight, path=path).shape == (0, 80)
    assert torch.equal(quant.linear(x.view(1, 5, k), weight, bias, path=path), full.view(1, 5, 80))
    with pytest.raises(ValueError, match="width 256 for a weight of width 512"):
        quant.linear(x.view(10, 256), weight, path=path)


@pytest.mark.parametrize("path", PATHS)
def test_glu_of_interleaved_rows_holds_over_the_float_range(path):
    """The 8-lane SiLU (its own exp) against float64, for gate sums from ~1e-3 to ~1e4 of both signs."""
    k = 256
    gate_up = QuantWeight([random_blocks("Q8_0", 64, k, 8, interleaved=True)])
    x = torch.randn(7, k) * torch.logspace(-1, 5, 7)[:, None]
    both = quant.linear(x, gate_up, path=path).double()
    want = torch.nn.functional.silu(both[:, :32]) * both[:, 32:]
    assert both[:, :32].abs().max() > 1000 and both[:, :32].min() < -100
    assert torch.allclose(quant.linear(x, gate_up, glu=True, path=path).double(), want, rtol=1e-5, atol=1e-6)
    straddling = QuantWeight([random_blocks("Q4_K", 40, k, 9, interleaved=True)])  # octet 2: gate 16..19, up 0..3
    assert not quant.fuses_glu(straddling)
    with pytest.raises(ValueError, match="multiple of 8"):
        quant.linear(x, straddling, glu=True, path=path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(quant.X8_BYTES))
def test_interleaved_rows_multiply_as_the_file_rows(name, path):
    """Both layouts sum the same integer products per block; glu, bf16 and a fused weight whose parts are
    interleaved or not (the row count no multiple of 8) as well."""
    k = 512
    rows, x8 = random_blocks(name, 32, k, 6), random_blocks(name, 32, k, 6, interleaved=True)
    x = torch.randn(7, k)
    for glu in (False, True):
        want = quant.linear(x, QuantWeight([rows]), glu=glu, path=path)
        assert torch.allclose(quant.linear(x, QuantWeight([x8]), glu=glu, path=path), want, rtol=1e-5, atol=1e-5)
    bf16 = quant.linear(x.bfloat16(), QuantWeight([x8]), path=path)
    assert torch.allclose(bf16.float(), quant.linear(x.bfloat16(), QuantWeight([rows]), path=path).float(),
                          rtol=1e-2, atol=1e-2)
    odd = random_blocks("Q6_K" if name == "Q4_K" else "Q4_K", 12, k, 7)
    assert quant.interleave(odd) is odd
    fused = QuantWeight([quant.for_kernels(odd), quant.for_kernels(rows)])
    assert [p.interleaved for p in fused.parts] == [False, quant.isa() != "baseline"]
    assert torch.allclose(quant.linear(x, fused, path=path), quant.linear(x, QuantWeight([odd, rows]), path=path),
                          rtol=1e-5, atol=1e-5)


def test_quantize_at_load_round_trips():
    w = torch.randn(64, 256) * 0.02
    # half a step (Q8_0, plus the scale's float16 rounding); Q4_0's step is max / 8, and +max rounds to 7 steps
    for kind, bound in (("q8_0", 0.6 / 127), ("q4_0", 1.01 / 8)):
        t = quant.quantize(w, kind)
        back = quant.dequantize(QuantWeight([t]))
        amax = w.abs().reshape(64, -1, 32).amax(-1, keepdim=True)
        assert ((back - w).abs().reshape(64, -1, 32) <= amax * bound + 1e-6).all()
