"""Linear layers on packed weights (oneDNN's, or Flock's bf16 GEMM) equal F.linear on the plain weights (bf16 to its rounding)."""

import pytest
import torch
import torch.nn.functional as F

from flock.model import gemm, linear
from flock.model.linear import Linear

CPU = torch.device("cpu")
TOLERANCE = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(0, 96), (1, 96), (5, 96), (300, 96), (2, 7, 96)])
def test_prepacked_equals_f_linear(dtype, bias, shape):
    if linear.unavailable(dtype, CPU):
        pytest.skip(linear.unavailable(dtype, CPU))
    torch.manual_seed(len(shape) + shape[0])
    layer = Linear(96, 160, bias=bias).to(dtype)
    weight = layer.weight.detach().clone()
    x = torch.randn(shape).to(dtype)
    with torch.inference_mode():
        expected = F.linear(x, weight, layer.bias)
        layer.prepack()
        got = layer(x)
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_prepack_releases_the_plain_weight_unless_kept():
    if linear.unavailable(torch.float32, CPU):
        pytest.skip(linear.unavailable(torch.float32, CPU))
    released, kept = Linear(8, 4), Linear(8, 4)
    released.prepack()
    kept.prepack(keep_weight=True)
    assert released.weight.numel() == 0
    assert kept.weight.shape == (4, 8)


def test_unavailable_names_the_reason():
    assert "float64" in linear.unavailable(torch.float64, CPU)
    assert "cuda" in linear.unavailable(torch.float32, torch.device("cuda"))


GEMM_WHY = gemm.unavailable(torch.bfloat16, CPU)
NATIVE = pytest.mark.skipif(GEMM_WHY is not None, reason=f"bf16 GEMM: {GEMM_WHY}")
# the GEMM this CPU runs (None), and the AMX kernel with its tiles emulated, on every CPU (on AVX512-BF16 ones also
# with the amx build's own epilogues)
PATHS = [pytest.param(None, marks=NATIVE, id=gemm.isa() or "native"), *gemm.emulated_paths()]


def packed_product(x, weight, path, bias=None, dtype=torch.bfloat16, glu=False):
    """x W^T (+ bias) by the GEMM of `path`; skipped where that GEMM does not take the width."""
    if not gemm.takes(weight.shape[1], path):
        pytest.skip(f"the {path or gemm.isa()} GEMM does not take K = {weight.shape[1]}")
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    with torch.inference_mode():
        return gemm.linear(x, gemm.pack(weight, glu=glu), n, bias, dtype, glu=glu, path=path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows, k, n", [(0, 96, 160), (1, 96, 160), (5, 96, 16), (7, 576, 960), (13, 64, 200),
                                        (17, 64, 130), (47, 288, 96), (64, 320, 200), (80, 64, 130),
                                        (200, 1536, 576), (2049, 64, 70)])
def test_bf16_gemm_is_the_float_product_rounded_once(path, bias, rows, k, n):
    """Every tile shape (partial row tiles and column blocks, several row panels): fp32 sums of exact bf16
    products, one rounding."""
    torch.manual_seed(rows + k + n)
    weight = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, k).to(torch.bfloat16)
    product = x.double() @ weight.double().T
    exact = product + (b.double() if bias else 0)
    got = packed_product(x, weight, path, b).double()
    assert got.shape == (rows, n)
    # fp32 sums of K products (each exact in fp32), rounded to bf16 once; a bias added in bf16 rounds again
    sums = k * 2**-23 * (x.double().abs() @ weight.double().abs().T)
    bound = 2**-8 * (product.abs() + (exact.abs() if bias else 0)) + sums + 1e-30
    assert bool(((got - exact).abs() <= bound).all())


@NATIVE
def test_a_layer_packs_its_pairs_and_releases_its_weight():
    layer = Linear(64, 48).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    x = torch.randn(9, 64).to(torch.bfloat16)
    with torch.inference_mode():
        layer.prepack(pairs=True)
        torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias), **TOLERANCE[torch.bfloat16])
    assert layer.pairs is not None and layer.weight.numel() == 0


@pytest.mark.parametrize("path", PATHS)
def test_bf16_gemm_takes_strided_rows(path):
    weight = torch.randn(48, 64).to(torch.bfloat16)
    x = torch.randn(9, 80).to(torch.bfloat16)[:, 8:72]  # rows with a stride
    torch.testing.assert_close(packed_product(x, weight, path), F.linear(x, weight), **TOLERANCE[torch.bfloat16])


@NATIVE
def test_widths_the_bf16_gemm_does_not_take_go_to_onednn():
    width = 48 if gemm.isa() == "amx" else 63
    layer = Linear(width, 8).to(torch.bfloat16)
    layer.prepack(pairs=True)
    assert not gemm.takes(width) and layer.pairs is None and layer.prepacked is not None


def test_the_amx_gemm_refuses_a_width_it_does_not_take():
    x, weight = torch.randn(3, 48).to(torch.bfloat16), torch.randn(16, 48).to(torch.bfloat16)
    assert not gemm.takes(48, gemm.EMULATED_AMX) and gemm.takes(48, "avx512bf16")
    with pytest.raises(RuntimeError, match="K = 48"):
        gemm.linear(x, gemm.pack(weight), 16, path=gemm.EMULATED_AMX)


def test_bf16_gemm_says_why_it_does_not_run():
    assert "float32" in gemm.unavailable(torch.float32, CPU)
    assert "cuda" in gemm.unavailable(torch.bfloat16, torch.device("cuda"))


@pytest.mark.parametrize("path", PATHS)
def test_bf16_gemm_gives_its_float32_sums_unrounded_when_asked(path):
    torch.manual_seed(3)
    weight = torch.randn(1000, 576).to(torch.bfloat16)
    x = torch.randn(13, 576).to(torch.bfloat16)
    exact = x.double() @ weight.double().T
    got = packed_product(x, weight, path, dtype=torch.float32)
    assert got.dtype == torch.float32
    error = (got.double() - exact).abs()
    assert error.max().item() < 1e-4 * exact.abs().max().item()  # bf16 rounding would leave ~4e-3
    assert (packed_product(x, weight, path).double() - exact).abs().max().item() > error.max().item()


@pytest.mark.parametrize("path", PATHS)
def test_bf16_gemm_writes_into_a_given_output(path):
    torch.manual_seed(4)
    weight, x, bias = torch.randn(130, 64).to(torch.bfloat16), torch.randn(9, 64).to(torch.bfloat16), torch.randn(130)
    packed = gemm.pack(weight)
    with torch.inference_mode():
        fresh = gemm.linear(x, packed, 130, bias, torch.float32, path=path)
        buffer = torch.full((12, 130), float("nan"))
        got = gemm.linear(x, packed, 130, bias, torch.float32, path=path, out=buffer[:9])
        assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, fresh) and buffer[9:].isnan().all()
        for wrong in (torch.empty(9, 131), torch.empty(9, 130, dtype=torch.bfloat16), torch.empty(130, 9).T):
            with pytest.raises(ValueError, match="GEMM output"):
                gemm.linear(x, packed, 130, dtype=torch.float32, path=path, out=wrong)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n, k, glu", [(320, 128, False), (130, 64, False), (200, 96, True)])
def test_a_rows_outputs_do_not_depend_on_the_other_rows_or_the_threads(path, n, k, glu):
    """The same fp32 sums for a row alone, among 7, 40 or 100 rows, on 1, 2 or 3 threads: the threads may split a
    block's K in two, and the second goes on from the first's sums, so every sum is added in the same order."""
    torch.manual_seed(n + k)
    weight = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(100, k).to(torch.bfloat16)
    dtype = torch.bfloat16 if glu else torch.float32  # the GLU epilogue writes bf16
    threads = torch.get_num_threads()
    try:
        got = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            got += [packed_product(x[:rows], weight, path, dtype=dtype, glu=glu)[:1] for rows in (1, 7, 40, 100)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(g, got[0]) for g in got)


@pytest.mark.parametrize("path", PATHS)
def test_a_calls_rows_do_not_see_the_rows_of_calls_before(path):
    """A call's last rows, short of a tile, go through a tile each thread keeps across calls: rows an earlier
    call left there (inf and NaN here) change nothing."""
    torch.manual_seed(3)
    weight = torch.randn(130, 96).to(torch.bfloat16)
    x = torch.randn(3, 96).to(torch.bfloat16)
    clean = packed_product(x, weight, path)
    packed_product(torch.full((15, 96), float("nan")).to(torch.bfloat16), weight, path)
    packed_product(torch.full((31, 96), float("inf")).to(torch.bfloat16), weight, path)
    assert torch.equal(packed_product(x, weight, path), clean)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows, k, inter", [(1, 96, 160), (5, 64, 16), (7, 576, 1536), (13, 18, 33), (200, 96, 70),
                                            (19, 64, 40), (50, 160, 40)])
def test_bf16_gemm_with_silu_and_mul_is_the_float_glu_rounded_once(path, rows, k, inter):
    """A gate_up weight packed for SiLU-and-mul: silu(gate) * up of the fp32 sums, rounded once, every tile
    shape (partial 32-column blocks, partial row tiles)."""
    torch.manual_seed(rows + k + inter)
    weight = torch.randn(2 * inter, k).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    h = x.double() @ weight.double().T
    exact = F.silu(h[:, :inter]) * h[:, inter:]
    got = packed_product(x, weight, path, glu=True).double()
    assert got.shape == (rows, inter)
    # the fp32 sums' error (|silu'| <= 1.1) through the product, then one bf16 rounding
    sums = k * 2**-23 * (x.double().abs() @ weight.double().abs().T)
    gate, up = h[:, :inter], h[:, inter:]
    bound = (2**-8 + 1e-6) * exact.abs() + 1.1 * sums[:, :inter] * up.abs() + (gate.abs() + 1) * sums[:, inter:] + 1e-30
    assert bool(((got - exact).abs() <= bound).all())


@NATIVE
def test_a_gate_up_layer_fuses_silu_and_mul_without_a_bias():
    fused, biased = Linear(64, 64, bias=False).to(torch.bfloat16), Linear(64, 64).to(torch.bfloat16)
    fused.prepack(pairs=True, silu_and_mul=True)
    biased.prepack(pairs=True, silu_and_mul=True)
    assert fused.silu_and_mul and fused(torch.randn(3, 64).to(torch.bfloat16)).shape == (3, 32)
    assert not biased.silu_and_mul and biased.pairs is not None
