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


@pytest.mark.skipif(GEMM_WHY is not None, reason=f"bf16 GEMM: {GEMM_WHY}")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows, k, n", [(0, 96, 160), (1, 96, 160), (5, 96, 16), (7, 576, 960), (13, 64, 200),
                                        (200, 1536, 576), (2049, 64, 70)])
def test_bf16_gemm_is_the_float_product_rounded_once(bias, rows, k, n):
    """Every tile shape (1-6 rows, partial column blocks): fp32 sums of exact bf16 products, one rounding."""
    torch.manual_seed(rows + k + n)
    layer = Linear(k, n, bias=bias).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    x = torch.randn(rows, k).to(torch.bfloat16)
    product = x.double() @ weight.double().T
    exact = product + (layer.bias.double() if bias else 0)
    with torch.inference_mode():
        layer.prepack(pairs=True)
        got = layer(x).double()
    assert layer.pairs is not None and layer.weight.numel() == 0
    assert got.shape == (rows, n)
    # fp32 sums of K products (each exact in fp32), rounded to bf16 once; a bias added in bf16 rounds again
    sums = k * 2**-23 * (x.double().abs() @ weight.double().abs().T)
    bound = 2**-8 * (product.abs() + (exact.abs() if bias else 0)) + sums + 1e-30
    assert bool(((got - exact).abs() <= bound).all())


@pytest.mark.skipif(GEMM_WHY is not None, reason=f"bf16 GEMM: {GEMM_WHY}")
def test_bf16_gemm_takes_strided_rows_and_leaves_odd_widths_to_onednn():
    layer = Linear(64, 48).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    x = torch.randn(9, 80).to(torch.bfloat16)[:, 8:72]  # rows with a stride
    with torch.inference_mode():
        layer.prepack(pairs=True)
        torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias), **TOLERANCE[torch.bfloat16])
    odd = Linear(63, 8).to(torch.bfloat16)
    odd.prepack(pairs=True)
    assert odd.pairs is None and odd.prepacked is not None


def test_bf16_gemm_says_why_it_does_not_run():
    assert "float32" in gemm.unavailable(torch.float32, CPU)
    assert "cuda" in gemm.unavailable(torch.bfloat16, torch.device("cuda"))


@pytest.mark.skipif(GEMM_WHY is not None, reason=f"bf16 GEMM: {GEMM_WHY}")
def test_bf16_gemm_gives_its_float32_sums_unrounded_when_asked():
    torch.manual_seed(3)
    layer = Linear(576, 1000, bias=False).to(torch.bfloat16)
    x = torch.randn(13, 576).to(torch.bfloat16)
    exact = x.double() @ layer.weight.detach().double().T
    with torch.inference_mode():
        layer.prepack(pairs=True)
        got = layer(x, float32=True)
    assert got.dtype == torch.float32
    error = (got.double() - exact).abs()
    assert error.max().item() < 1e-4 * exact.abs().max().item()  # bf16 rounding would leave ~4e-3
    assert (layer(x).double() - exact).abs().max().item() > error.max().item()


@pytest.mark.skipif(GEMM_WHY is not None, reason=f"bf16 GEMM: {GEMM_WHY}")
@pytest.mark.parametrize("rows, k, inter", [(1, 96, 160), (5, 64, 16), (7, 576, 1536), (13, 18, 33), (200, 96, 70)])
def test_bf16_gemm_with_silu_and_mul_is_the_float_glu_rounded_once(rows, k, inter):
    """A gate_up weight packed for SiLU-and-mul: silu(gate) * up of the fp32 sums, rounded once, every tile
    shape (partial 32-column blocks, 1-6 rows); a layer with a bias is not fused."""
    torch.manual_seed(rows + k + inter)
    layer = Linear(k, 2 * inter, bias=False).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    x = torch.randn(rows, k).to(torch.bfloat16)
    h = x.double() @ weight.double().T
    exact = F.silu(h[:, :inter]) * h[:, inter:]
    with torch.inference_mode():
        layer.prepack(pairs=True, silu_and_mul=True)
        got = layer(x).double()
    assert layer.silu_and_mul and got.shape == (rows, inter)
    # the fp32 sums' error (|silu'| <= 1.1) through the product, then one bf16 rounding
    sums = k * 2**-23 * (x.double().abs() @ weight.double().abs().T)
    gate, up = h[:, :inter], h[:, inter:]
    bound = (2**-8 + 1e-6) * exact.abs() + 1.1 * sums[:, :inter] * up.abs() + (gate.abs() + 1) * sums[:, inter:] + 1e-30
    assert bool(((got - exact).abs() <= bound).all())
    biased = Linear(k, 2 * inter).to(torch.bfloat16)
    biased.prepack(pairs=True, silu_and_mul=True)
    assert not biased.silu_and_mul and biased.pairs is not None
