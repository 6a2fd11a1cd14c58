"""Linear layers on oneDNN-prepacked weights equal F.linear on the plain weights (bf16 to its rounding)."""

import pytest
import torch
import torch.nn.functional as F

from flock.model import linear
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
