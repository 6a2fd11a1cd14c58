"""Linear layers whose weights can be prepacked for oneDNN's CPU GEMM, or kept quantized (flock.model.quant).

PyTorch's plain CPU linear hands oneDNN (bf16) or MKL (fp32) a row-major weight on every call; oneDNN reorders
it into its blocked layout each time, and MKL takes a slow path on AMD CPUs. A weight reordered once after
loading (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's weight freezing does) and multiplied by
`torch.ops.mkldnn._linear_pointwise` runs 1.1-4x faster on the narrow projections and the few rows of decode
steps (bench/step_profile.py). `unavailable(dtype, device)` says why a model cannot use it (a build without
oneDNN, a CPU without bf16 support, float64); plain `F.linear` stays the path then.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from flock.model import gemm, quant


@functools.cache
def _unavailable(dtype: torch.dtype) -> str | None:
    if dtype not in (torch.bfloat16, torch.float32):
        return f"prepacked weights take bfloat16 and float32, not {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN"
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((3, 64), (48, 64), (48,)))
    try:
        got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), b,
                                                 "none", [], "")
    except (RuntimeError, AttributeError) as e:  # no op, or the CPU lacks the dtype
        return f"oneDNN cannot run a {dtype} linear here: {str(e).strip()[:300]}"
    if not torch.allclose(got.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2):
        return "oneDNN's prepacked linear disagrees with F.linear here"
    return None


def unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why prepacked weights cannot serve a model of this dtype on this device, or None when they can."""
    if device.type != "cpu":
        return f"prepacked weights are a CPU path, not {device.type}"
    return _unavailable(dtype)


class Linear(nn.Linear):
    """nn.Linear that multiplies by a packed copy of its weight once `prepack()` has made it: oneDNN's blocked
    layout, or the pairs of Flock's bf16 GEMM (flock.model.gemm)."""

    prepacked: torch.Tensor | None = None
    pairs: torch.Tensor | None = None
    qweight: quant.QuantWeight | None = None
    silu_and_mul = False  # packed so: forward gives silu(gate) * up of the outputs [gate | up]
    lora = None  # flock.lora.layers.LinearLoRA of an engine serving LoRA adapters: their updates on its output

    def use_quantized(self, weight: quant.QuantWeight, silu_and_mul: bool = False) -> None:
        """Multiply by quantized blocks from now on (the float weight is released); `silu_and_mul` as in
        `prepack`, where gate and up share one quant type."""
        self.qweight = weight
        self.silu_and_mul = silu_and_mul and self.bias is None and quant.fuses_glu(weight)
        self.weight.data = self.weight.data.new_empty(0)

    def prepack(self, keep_weight: bool = False, pairs: bool = False, silu_and_mul: bool = False) -> None:
        """Pack the weight for oneDNN, or with `pairs` (bf16, a width it takes) for Flock's GEMM, there with
        `silu_and_mul` fused when asked (outputs [gate | up], no bias); the plain weight is released unless
        kept (tied embeddings use it)."""
        if pairs and gemm.takes(self.in_features):
            self.silu_and_mul = silu_and_mul and self.bias is None and self.out_features % 2 == 0
            self.pairs = gemm.pack(self.weight, glu=self.silu_and_mul)
        else:
            self.prepacked = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        if not keep_weight:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor, float32: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b (+ the step's LoRA updates); `float32`: Flock's GEMM returns its fp32 sums unrounded (other
        paths: the model's dtype). `out`: float32 rows that Flock's GEMMs write (other paths return their own)."""
        y = self._product(x, float32, out)
        return y if self.lora is None or not self.lora.step.active else self.lora.add_to(y, x)

    def _product(self, x: torch.Tensor, float32: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        out = out if float32 and x.dim() == 2 else None
        if self.qweight is not None:
            return quant.linear(x, self.qweight, self.bias, torch.float32 if float32 else x.dtype, self.silu_and_mul,
                                out=out)
        if self.silu_and_mul:
            return gemm.linear(x, self.pairs, self.out_features // 2, glu=True)
        if self.pairs is not None:
            return gemm.linear(x, self.pairs, self.out_features, self.bias, torch.float32 if float32 else x.dtype,
                               out=out)
        if self.prepacked is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.prepacked, self.bias, "none", [], "")


class Embedding(nn.Embedding):
    """nn.Embedding that can look its rows up in quantized blocks (`use_quantized`)."""

    qweight: quant.QuantWeight | None = None

    def use_quantized(self, weight: quant.QuantWeight) -> None:
        self.qweight = weight
        self.weight.data = self.weight.data.new_empty(0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return super().forward(ids)
        return quant.dequantize_rows(self.qweight, ids, self.weight.dtype)
