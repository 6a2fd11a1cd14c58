"""A mixture layer's experts in one call (flock.model.moe) against a GEMM call per (token, expert) pair: quantized
experts on every ISA path of the int8 kernels this CPU runs, packed bf16 experts on its bf16 GEMM and the AMX
one's emulation."""

import pytest
import torch

from flock.model import gemm, moe, quant
from flock.model.quant import QuantWeight
from tests.model.test_quant import PATHS, TILE_PATHS, random_blocks

BF16_PATHS = [gemm.isa()] * (gemm.isa() is not None) + gemm.emulated_paths()

HIDDEN = 256
# [gate | up] type, down type, inter width, interleaved
SHAPES = [("Q4_K", "Q6_K", 256, True), ("Q8_0", "Q4_0", 64, False), ("Q4_K", "Q8_0", 96, True),
          ("IQ4_XS", "IQ4_XS", 256, True), ("Q2_K", "Q3_K", 256, True), ("IQ3_S@IQ4_XS", "IQ2_XXS@IQ4_XS", 256, True)]


def make_experts(gu: str, down: str, inter: int, interleaved: bool, count: int = 6, seed: int = 0):
    gate_ups = [QuantWeight([random_blocks(gu, 2 * inter, HIDDEN, seed + 2 * e, interleaved)]) for e in range(count)]
    downs = [QuantWeight([random_blocks(down, HIDDEN, inter, seed + 2 * e + 1, interleaved)]) for e in range(count)]
    return gate_ups, downs


def reference(x, logits, gate_ups, downs, top_k, renormalize, float32_weights, path, linear=None):
    """Each pair by calls of its own, routed and summed as SparseMoE.mixture does; `linear(x, weight, glu)`: the
    GEMM (default the quantized one)."""
    linear = linear or (lambda rows, w, glu: quant.linear(rows, w, glu=glu, path=path))
    weights, chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not float32_weights:
        weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(len(gate_ups)):
        for t, j in (chosen == e).nonzero().tolist():
            y = linear(linear(x[t:t + 1], gate_ups[e], True), downs[e], False)
            out[t] += (y[0] * weights[t, j]).to(x.dtype)
    return out, chosen


@pytest.mark.parametrize("path", sorted(set(PATHS) | set(TILE_PATHS)))
@pytest.mark.parametrize("gu, down, inter, interleaved", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_equals_a_call_per_pair(path, gu, down, inter, interleaved, dtype):
    gate_ups, downs = make_experts(gu, down, inter, interleaved)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(23, HIDDEN, generator=g).to(dtype)  # runs of 1 to ~10 pairs: the tiles take some
    logits = torch.randn(23, 6, generator=g).to(dtype)
    for top_k, renormalize, float32_weights in ((2, True, False), (3, False, True)):
        experts = moe.quantized(gate_ups, downs, moe.Router(top_k, renormalize, float32_weights))
        got = experts(x, logits, path=path)
        want, _ = reference(x, logits, gate_ups, downs, top_k, renormalize, float32_weights, path)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2 * want.abs().max())
        assert got.dtype == dtype and torch.allclose(got.float(), want.float(), **tol)


@pytest.mark.parametrize("path", sorted(set(PATHS) | set(TILE_PATHS)))
def test_a_token_gets_the_same_bits_in_any_batch(path):
    gate_ups, downs = make_experts("Q4_K", "Q6_K", 256, True)
    experts = moe.quantized(gate_ups, downs, moe.Router(2, True, False))
    g = torch.Generator().manual_seed(2)
    x, logits = torch.randn(40, HIDDEN, generator=g).bfloat16(), torch.randn(40, 6, generator=g).bfloat16()
    together = experts(x, logits, path=path)
    alone = torch.cat([experts(x[t:t + 1], logits[t:t + 1], path=path) for t in range(40)])
    order = torch.randperm(40, generator=g)
    shuffled = experts(x[order], logits[order], path=path)
    assert torch.equal(together, alone) and torch.equal(shuffled, together[order])


def test_routing_matches_torch_and_bad_input_is_refused():
    gate_ups, downs = make_experts("Q8_0", "Q8_0", 64, False)
    experts = moe.quantized(gate_ups, downs, moe.Router(1, False, True))
    x = torch.randn(5, HIDDEN)
    logits = torch.full((5, 6), -4.0)
    logits[torch.arange(5), torch.tensor([3, 0, 5, 5, 2])] = 4.0
    got = experts(x, logits)
    for t, e in enumerate([3, 0, 5, 5, 2]):  # top 1, not renormalized: the expert's output times its probability
        p = torch.softmax(logits[t], -1)[e]
        want = quant.linear(quant.linear(x[t:t + 1], gate_ups[e], glu=True), downs[e])[0] * p
        assert torch.allclose(got[t], want, rtol=1e-5, atol=1e-6)
    nan = x.clone()
    nan[1, 7] = float("nan")
    out = experts(nan, logits)
    assert out[1].isnan().all() and torch.equal(out[[0, 2, 3, 4]], got[[0, 2, 3, 4]])
    assert experts(x[:0], logits[:0]).shape == (0, HIDDEN)
    with pytest.raises(ValueError, match="logits of their dtype"):
        experts(x, logits.bfloat16())
    mixed = [QuantWeight([random_blocks("Q8_0", 64, HIDDEN), random_blocks("Q4_0", 64, HIDDEN)])] * 6
    router = moe.Router(1, False, True)
    assert moe.quantized(mixed, downs, router) is None  # gate and up of two types: a call per expert
    other = [QuantWeight([random_blocks("Q4_0", HIDDEN, 64)])] + downs[1:]
    assert moe.quantized(gate_ups, other, router) is None


@pytest.mark.parametrize("path", BF16_PATHS)
def test_packed_bf16_experts_equal_a_call_per_pair(path):
    g = torch.Generator().manual_seed(3)
    inter, count = 96, 5
    gate_ups = [torch.randn(2 * inter, HIDDEN, generator=g).bfloat16() * 0.05 for _ in range(count)]
    downs = [torch.randn(HIDDEN, inter, generator=g).bfloat16() * 0.05 for _ in range(count)]
    packed_gu, packed_down = [gemm.pack(w, glu=True) for w in gate_ups], [gemm.pack(w) for w in downs]
    x, logits = torch.randn(30, HIDDEN, generator=g).bfloat16(), torch.randn(30, count, generator=g).bfloat16()

    def linear(rows, w, glu):  # the packed weight of the unpacked one
        i = next(j for j, t in enumerate(gate_ups if glu else downs) if t is w)
        return gemm.linear(rows, (packed_gu if glu else packed_down)[i], inter if glu else HIDDEN, glu=glu, path=path)

    for top_k, renormalize, float32_weights in ((2, True, False), (3, False, True)):
        experts = moe.packed(packed_gu, packed_down, HIDDEN, inter, moe.Router(top_k, renormalize, float32_weights))
        got = experts(x, logits, path=path)
        want, _ = reference(x, logits, gate_ups, downs, top_k, renormalize, float32_weights, path, linear)
        assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max())
        alone = torch.cat([experts(x[t:t + 1], logits[t:t + 1], path=path) for t in range(len(x))])
        assert torch.equal(alone, got)  # a token's rows never depend on the others'
    with pytest.raises(ValueError, match="packed experts take tokens of torch.bfloat16"):
        experts(x.float(), logits.float())
