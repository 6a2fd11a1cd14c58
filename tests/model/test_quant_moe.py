"""A mixture layer's quantized experts in one call (quant.moe, csrc/quant_moe.h) against a quantized GEMM call
per (token, expert) pair, on every ISA path this CPU runs."""

import pytest
import torch

from flock.model import quant
from flock.model.quant import QuantWeight
from tests.model.test_quant import PATHS, TILE_PATHS, random_blocks

HIDDEN = 256
# [gate | up] type, down type, inter width, interleaved
SHAPES = [("Q4_K", "Q6_K", 256, True), ("Q8_0", "Q4_0", 64, False), ("Q4_K", "Q8_0", 96, True)]


def make_experts(gu: str, down: str, inter: int, interleaved: bool, count: int = 6, seed: int = 0):
    gate_ups = [QuantWeight([random_blocks(gu, 2 * inter, HIDDEN, seed + 2 * e, interleaved)]) for e in range(count)]
    downs = [QuantWeight([random_blocks(down, HIDDEN, inter, seed + 2 * e + 1, interleaved)]) for e in range(count)]
    return gate_ups, downs


def reference(x, logits, gate_ups, downs, top_k, renormalize, float32_weights, path):
    """Each pair by calls of its own, routed and summed as SparseMoE.mixture does."""
    weights, chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not float32_weights:
        weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(len(gate_ups)):
        for t, j in (chosen == e).nonzero().tolist():
            h = quant.linear(x[t:t + 1], gate_ups[e], glu=True, path=path)
            y = quant.linear(h, downs[e], path=path)
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
        experts = quant.experts(gate_ups, downs, top_k, renormalize, float32_weights)
        got = quant.moe(x, logits, experts, path=path)
        want, _ = reference(x, logits, gate_ups, downs, top_k, renormalize, float32_weights, path)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2 * want.abs().max())
        assert got.dtype == dtype and torch.allclose(got.float(), want.float(), **tol)


@pytest.mark.parametrize("path", sorted(set(PATHS) | set(TILE_PATHS)))
def test_a_token_gets_the_same_bits_in_any_batch(path):
    gate_ups, downs = make_experts("Q4_K", "Q6_K", 256, True)
    experts = quant.experts(gate_ups, downs, 2, True, False)
    g = torch.Generator().manual_seed(2)
    x, logits = torch.randn(40, HIDDEN, generator=g).bfloat16(), torch.randn(40, 6, generator=g).bfloat16()
    together = quant.moe(x, logits, experts, path=path)
    alone = torch.cat([quant.moe(x[t:t + 1], logits[t:t + 1], experts, path=path) for t in range(40)])
    order = torch.randperm(40, generator=g)
    shuffled = quant.moe(x[order], logits[order], experts, path=path)
    assert torch.equal(together, alone) and torch.equal(shuffled, together[order])


def test_routing_matches_torch_and_bad_input_is_refused():
    gate_ups, downs = make_experts("Q8_0", "Q8_0", 64, False)
    experts = quant.experts(gate_ups, downs, 1, False, True)
    x = torch.randn(5, HIDDEN)
    logits = torch.full((5, 6), -4.0)
    logits[torch.arange(5), torch.tensor([3, 0, 5, 5, 2])] = 4.0
    got = quant.moe(x, logits, experts)
    for t, e in enumerate([3, 0, 5, 5, 2]):  # top 1, not renormalized: the expert's output times its probability
        p = torch.softmax(logits[t], -1)[e]
        want = quant.linear(quant.linear(x[t:t + 1], gate_ups[e], glu=True), downs[e])[0] * p
        assert torch.allclose(got[t], want, rtol=1e-5, atol=1e-6)
    nan = x.clone()
    nan[1, 7] = float("nan")
    out = quant.moe(nan, logits, experts)
    assert out[1].isnan().all() and torch.equal(out[[0, 2, 3, 4]], got[[0, 2, 3, 4]])
    assert quant.moe(x[:0], logits[:0], experts).shape == (0, HIDDEN)
    with pytest.raises(ValueError, match="logits of their dtype"):
        quant.moe(x, logits.bfloat16(), experts)
    mixed = [QuantWeight([random_blocks("Q8_0", 64, HIDDEN), random_blocks("Q4_0", 64, HIDDEN)])] * 6
    assert quant.experts(mixed, downs, 1, False, True) is None  # gate and up of two types: a call per expert
    other = [QuantWeight([random_blocks("Q4_0", HIDDEN, 64)])] + downs[1:]
    assert quant.experts(gate_ups, other, 1, False, True) is None
