"""The fused C kernels against the PyTorch ops they replace (the reference), on every ISA path this CPU runs.

RoPE and the residual add round exactly where PyTorch does: bit-exact. RMSNorm (its sum of squares in
another order) and SiLU (its own exp) may differ from the reference by the rounding of an input to a last
rounding step: in bf16 by at most 2 units in the last place (a flipped rounding of the normalised value, then
the weight's product rounded again), for under 1% of the elements; in fp32, where no bf16 rounding hides the
summation order, by at most 16 units (1e-6 relative).
"""

import pytest
import torch
import torch.nn.functional as F

from flock.model import fused_ops
from flock.model.config import ModelConfig
from flock.model.llama import RMSNorm
from flock.model.rope import RotaryEmbedding

CPU = torch.device("cpu")
ISAS = fused_ops.KERNEL.runnable()
DTYPES = [torch.bfloat16, torch.float32]
ROWS = [1, 7, 300]  # 300 x 576 elements run on the thread pool

pytestmark = [pytest.mark.skipif(fused_ops.unavailable(torch.float32, CPU) is not None,
                                reason=f"fused ops: {fused_ops.unavailable(torch.float32, CPU)}"),
              pytest.mark.usefixtures("no_grad")]


@pytest.fixture
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(params=ISAS, autouse=True)
def isa(request, monkeypatch):
    if why := fused_ops.KERNEL.unavailable(request.param):
        pytest.fail(f"the {request.param} build failed: {why}")
    monkeypatch.setattr(fused_ops, "isa", lambda: request.param)
    return request.param


def ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference in units of the reference's last place."""
    eps = torch.finfo(ref.dtype).eps
    spacing = torch.ldexp(torch.full_like(ref, eps, dtype=torch.float64),
                          torch.frexp(ref.double().abs().clamp_min(torch.finfo(ref.dtype).tiny))[1] - 1)
    return ((got.double() - ref.double()).abs() / spacing).max().item()


def assert_near(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if ref.dtype == torch.bfloat16:
        assert ulps(got, ref) <= 2
        assert (got != ref).float().mean().item() < 0.01
    else:
        assert ulps(got, ref) <= 16


def rows(n: int, cols: int, dtype: torch.dtype, scale: float = 1.0, stride: int | None = None) -> torch.Tensor:
    """n rows of `cols` values, optionally inside wider rows (a row stride above cols)."""
    x = (torch.randn(n, stride or cols) * scale).to(dtype)
    return x[:, :cols]


def random_norm(size: int, eps: float, dtype: torch.dtype) -> RMSNorm:
    """The reference RMSNorm with weights in [0.5, 1.5)."""
    norm = RMSNorm(size, eps).to(dtype)
    norm.weight.data = (torch.rand(size) + 0.5).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
def test_rms_norm(dtype, n):
    torch.manual_seed(n)
    norm = random_norm(576, 1e-5, dtype)
    x = rows(n, 576, dtype, scale=3.0, stride=600)
    assert_near(fused_ops.rms_norm(x, norm.weight, norm.eps), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
def test_add_rms_norm_in_place(dtype, n):
    torch.manual_seed(n)
    norm = random_norm(576, 1e-5, dtype)
    x, residual = rows(n, 576, dtype, stride=640), rows(n, 576, dtype, scale=4.0)
    expected, expected_residual = norm(x, residual)
    fused_ops.add_rms_norm_(x, residual, norm.weight, norm.eps)
    assert torch.equal(residual, expected_residual)
    assert_near(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
def test_head_rms_norm_in_place_leaves_the_other_heads(dtype, n):
    """Qwen3's q norm over the first 16 heads of 128 of each qkv row, in place; the k and v heads stay."""
    torch.manual_seed(n)
    norm = random_norm(128, 1e-6, dtype)
    qkv = rows(n, 24 * 128, dtype, scale=3.0, stride=24 * 128 + 64)
    before = qkv.clone()
    expected = norm(before[:, : 16 * 128].reshape(n, 16, 128)).reshape(n, -1)
    fused_ops.head_rms_norm_(qkv, norm.weight, norm.eps, 16, 128)
    assert_near(qkv[:, : 16 * 128], expected)
    assert torch.equal(qkv[:, 16 * 128 :], before[:, 16 * 128 :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("partial", [1.0, 0.75])  # Phi-4-mini's factor: the last quarter of each head passes
def test_rope_is_bit_exact_and_in_place(dtype, n, scaling, partial):
    torch.manual_seed(n)
    heads, kv_heads, head_dim = 9, 3, 64
    config = ModelConfig(model_type="llama", vocab_size=100, hidden_size=heads * head_dim, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         rope_theta=1e5, rope_scaling=scaling, partial_rotary_factor=partial)
    assert RotaryEmbedding(config, 8, dtype).cos.shape[1] == config.rotary_dim == head_dim * partial
    rope = RotaryEmbedding(config, 4096, dtype)
    qkv = rows(n, (heads + 2 * kv_heads) * head_dim, dtype)
    positions = torch.randint(0, 4096, (n,))
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_ref, k_ref = rope(positions, q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim))
    v_before = v.clone()
    fused_ops.rope_(qkv, positions, rope.cos, rope.sin, heads + kv_heads, head_dim)
    assert torch.equal(q.reshape(n, heads, head_dim), q_ref)
    assert torch.equal(k.reshape(n, kv_heads, head_dim), k_ref)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_act_and_mul(dtype, n, act):
    torch.manual_seed(n)
    gate_up = rows(n, 2 * 1536, dtype, scale=4.0, stride=3100)
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        assert_near(fused_ops.silu_and_mul(gate_up), F.silu(gate) * up)
    else:
        assert_gelu_near(fused_ops.gelu_and_mul(gate_up), gelu_exact(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
def test_scale_and_gated_add_in_place(dtype, n):
    """Granite's residual_multiplier (the bits of x * m) and Qwen2-MoE's shared expert added under its sigmoid
    gate."""
    torch.manual_seed(n)
    x, shared, gate = rows(n, 576, dtype, stride=600), rows(n, 576, dtype), rows(n, 1, dtype, scale=3.0)
    want = x * 0.22
    fused_ops.scale_(x, 0.22)
    assert torch.equal(x, want)
    want = x + torch.sigmoid(gate) * shared
    fused_ops.add_gated_(x, shared, gate)
    if dtype == torch.bfloat16:
        assert_near(x, want)
    else:  # the sigmoid within an ulp or two of PyTorch's; sums near 0 make that many ulps of theirs
        assert torch.allclose(x, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="add_gated_"):
        fused_ops.add_gated_(x, shared, gate.expand(n, 2).contiguous())


def assert_same_values(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal bits where the reference is a number (zeros' signs included), NaN where it is NaN."""
    assert torch.equal(got.isnan(), ref.isnan())
    number = ~ref.isnan()
    assert torch.equal(got[number].view(torch.int16), ref[number].view(torch.int16))


def test_bf16_rounding_special_values():
    """The residual add and RoPE round as PyTorch rounds every kind of value a vector lane can meet: denormals,
    ties to even, overflow to inf, NaN, signed zeros."""
    tiny = torch.finfo(torch.float32).tiny
    special = torch.tensor([tiny / 3, -tiny / 5, tiny * 0.999, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3e38,
                            -3e38, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1.0, -2.5, 7e-39])
    x = special.repeat(40).to(torch.bfloat16).reshape(10, 64)  # rows of 4 vectors of every value
    residual = torch.roll(x, 3, dims=1).clone()
    expected = x + residual
    fused_ops.add_rms_norm_(x.clone(), residual, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    assert_same_values(residual, expected)
    config = ModelConfig(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=64, rope_theta=1e4)
    rope = RotaryEmbedding(config, 64, torch.bfloat16)
    positions = torch.arange(10) * 5
    q_ref, _ = rope(positions, x.reshape(10, 1, 64), x[:, :0].reshape(10, 0, 64))
    fused_ops.rope_(x, positions, rope.cos, rope.sin, 1, 64)
    assert_same_values(x, q_ref.reshape(10, 64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_special_values(dtype):
    gate = torch.tensor([-1e4, -200.0, -100.0, -88.8, -87.5, -80.0, -1e-3, 0.0, -0.0, 1e-3, 5.0, 80.0, 88.5,
                         89.0, 1e4, float("inf"), float("-inf"), float("nan"), 1e-40]).to(dtype)
    up = torch.linspace(-2, 2, len(gate)).to(dtype)
    got = fused_ops.silu_and_mul(torch.cat([gate, up])[None])[0]
    expected = F.silu(gate) * up
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.isinf(), expected.isinf()) and torch.equal(got[got.isinf()], expected[expected.isinf()])
    finite = expected.isfinite()
    assert_gelu_near(got[finite], expected[finite])




def assert_gelu_near(got: torch.Tensor, ref: torch.Tensor) -> None:
    """As assert_near where the output is above 1e-20 (far below 0, gelu's exponent of ~2 g^3 / 25 turns a float
    rounding of it into up to ~1e-5 of relative error in fp32); within 1e-20 of it elsewhere."""
    tiny = ref.abs() <= 1e-20
    assert (got[tiny].double() - ref[tiny].double()).abs().max().item() <= 1e-20
    got, ref = got[~tiny], ref[~tiny]
    if ref.dtype == torch.bfloat16:
        assert_near(got, ref)
    else:
        assert ((got.double() - ref.double()).abs() / ref.double().abs()).max().item() <= 2e-5


def gelu_exact(gate: torch.Tensor) -> torch.Tensor:
    """F.gelu's tanh approximation, g (1 + tanh(z)) / 2 = g sigmoid(2 z), in float64 and rounded once to the gate's
    dtype: F.gelu's form loses the digits of 1 + tanh(z) far below 0 (gelu(-5) is ~1e-6), the kernel's keeps them."""
    g = gate.double()
    return (g * torch.sigmoid(2 * 0.7978845608028654 * (g + 0.044715 * g**3))).to(gate.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_and_mul_special_values(dtype):
    """NaN and -inf give NaN, inf gives inf, as F.gelu; far negative gates next to 0."""
    gate = torch.tensor([-1e4, -200.0, -30.0, -3.0, -1e-3, 0.0, -0.0, 1e-3, 3.0, 30.0, 1e4, float("inf"),
                         float("-inf"), float("nan"), 1e-40]).to(dtype)
    up = torch.linspace(-2, 2, len(gate)).to(dtype)
    got = fused_ops.gelu_and_mul(torch.cat([gate, up])[None])[0]
    expected = gelu_exact(gate) * up
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.isinf(), expected.isinf()) and torch.equal(got[got.isinf()], expected[expected.isinf()])
    finite = expected.isfinite()
    assert_gelu_near(got[finite], expected[finite])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, vocab", [(1, 1), (7, 129), (300, 49152)])
def test_argmax_equals_torch_ties_nan_and_inf_included(dtype, n, vocab):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, vocab, generator=g).to(dtype)
    x[:, -1] = x.max(dim=1).values  # a tie with an earlier maximum: the first one wins
    if n > 2:
        x[1, [vocab // 2, 3]] = float("nan")  # a NaN is the largest: the first NaN
        x[2] = float("-inf")
        x[2, vocab - 1] = float("inf")
    assert torch.equal(fused_ops.argmax(x), x.argmax(dim=-1))
    if vocab > 1:  # rows with a stride
        assert torch.equal(fused_ops.argmax(x[:, 1:]), x[:, 1:].argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, vocab", [(1, 1), (7, 129), (300, 4099)])
def test_count_above_equals_torch_ties_nan_and_inf_included(dtype, n, vocab):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, vocab, generator=g).to(dtype)
    v = x[:, vocab // 2].float().clone()  # ties: the entry itself and any equal one are not above
    if n > 2:
        x[1, 3], x[2, :5] = float("nan"), float("inf")
        v[0] = float("nan")  # nothing exceeds NaN
    for rows in (x, x[:, 1:]):  # contiguous and strided rows
        assert torch.equal(fused_ops.count_above(rows, v), (rows.float() > v[:, None]).sum(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_draws_what_the_pytorch_sampler_draws(dtype):
    from flock.sample.sampler import draw

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 1000, generator=g) * 4).to(dtype)
    x[3, 500:] = float("-inf")  # weight 0: never drawn, whatever u
    temps = torch.linspace(0.3, 2.0, 64)
    temps[::4] = 1.0  # the default temperature, whose division the kernel skips
    u = torch.rand(64, dtype=torch.float64, generator=g)
    expected = draw((x.float() / temps[:, None]).softmax(-1), u)
    assert torch.equal(fused_ops.sample(x, temps, u), expected)
    edge = torch.tensor([0.0, 1 - 1e-12], dtype=torch.float64)  # the ends of the cumulative sum
    assert fused_ops.sample(x[[3, 3]], temps[[3, 3]], edge).tolist()[0] == 0
    assert 0 <= fused_ops.sample(x[[3, 3]], temps[[3, 3]], edge).tolist()[1] < 500
    bad = x[:2].clone()
    bad[0, 5], bad[1] = float("nan"), float("-inf")
    assert fused_ops.sample(bad, temps[:2], u[:2]).tolist() == [-1, -1]


def test_bad_inputs_are_named():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="contiguous rows"):
        fused_ops.silu_and_mul(x.t())
    cos = torch.randn(16, 4)
    with pytest.raises(ValueError, match="int64 position per row"):
        fused_ops.rope_(x, torch.zeros(4, dtype=torch.int32), cos, cos, 2, 4)
    with pytest.raises(ValueError, match="int64 position per row"):
        fused_ops.rope_(x, torch.zeros(3, dtype=torch.int64), cos, cos, 2, 4)


def test_unavailable_names_the_reason():
    assert "float64" in fused_ops.unavailable(torch.float64, CPU)
    assert "cuda" in fused_ops.unavailable(torch.float32, torch.device("cuda"))


def nucleus_probabilities(x: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """A row's top-k then top-p distribution in float64, tokens ranked by logit, ties by index."""
    y = x.double() / t
    w = (y - y.max()).exp()
    order = sorted(range(len(x)), key=lambda j: (-float(x[j]), j))[: k if 0 < k < len(x) else None]
    mass, kept, before = float(w[order].sum()), [], 0.0
    for j in order:
        if before >= p * mass:
            break
        kept.append(j)
        before += float(w[j])
    probs = torch.zeros(len(x), dtype=torch.float64)
    probs[kept] = w[kept]
    return probs / probs.sum()


def grid_draws(x: torch.Tensor, t: float, k: int, p: float, n: int = 4000) -> torch.Tensor:
    """The tokens nucleus_sample draws from row x at n uniforms spread evenly over [0, 1)."""
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    top_p = torch.full((n,), p, dtype=torch.float64)
    return fused_ops.nucleus_sample(x.expand(n, -1), torch.full((n,), t), torch.full((n,), k), top_p, u)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, k, p", [(1.0, 0, 0.9), (0.7, 40, 1.0), (0.6, 50, 0.5), (1.4, 0, 0.97), (2.0, 5, 0.99)])
def test_nucleus_sample_draws_the_top_k_top_p_distribution(dtype, t, k, p):
    """Each token's share of a grid of uniforms is its probability under top-k, then top-p (to one grid step), on
    strided rows too; bf16 logits hold many ties, which the ranking breaks by index."""
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(2, 1001, generator=g) * 3).to(dtype)
    x[0, 1::7] = x[0, 0]  # ties with a likely token
    for row in (x[0], x[1, 1:]):
        tokens = grid_draws(row, t, k, p)
        if k and (tokens < 0).all():  # tied at the k-th token: the caller's full path draws the row
            ranked = row.float().sort(descending=True).values / t
            assert ranked[k - 1] == ranked[k]
            continue
        expected = nucleus_probabilities(row.float(), t, k, p)
        assert bool((tokens >= 0).all()) and bool((expected[tokens] > 0).all())
        assert torch.allclose(torch.bincount(tokens, minlength=len(row)).double() / len(tokens), expected,
                              atol=1.5 / len(tokens))


def test_nucleus_sample_keeps_a_cut_tie_group_in_index_order():
    """Three equal top logits and a top_p the first two reach: those two, never the third."""
    x = torch.full((1, 300), -30.0)
    x[0, [7, 3, 250]] = 2.0
    tokens = grid_draws(x[0], 1.0, 0, 0.5)
    assert set(tokens.tolist()) == {3, 7}
    assert abs(int((tokens == 3).sum()) - int((tokens == 7).sum())) <= 1


def test_nucleus_sample_cuts_inside_its_last_bucket():
    """A cut among tokens 32+ nats below the top (the kernel's last bucket, sorted whole): the top token's mass
    falls short of top_p by about 230 of their 400."""
    x = torch.full((1, 500), -60.0)
    x[0, 0] = 0.0
    x[0, 100:500] = -torch.linspace(32.5, 33.0, 400)
    p = 1 - 1e-12
    expected = nucleus_probabilities(x[0], 1.0, 0, p)
    assert 100 < int((expected > 0).sum()) < 400
    for u, tail in ((1 - 1e-13, True), (1 - 1e-12, True), (0.5, False)):  # u of the kept mass: the top token's 1
        token = fused_ops.nucleus_sample(x, torch.ones(1), torch.zeros(1), torch.full((1,), p, dtype=torch.float64),
                                         torch.full((1,), u, dtype=torch.float64)).item()
        assert expected[token] > 0 and (token >= 100) == tail


def test_nucleus_sample_leaves_rows_it_cannot_draw_to_the_caller():
    x = torch.randn(3, 100)
    x[0, 5], x[1] = float("nan"), float("-inf")
    x[2] = 0.0  # every token tied at the top-k boundary
    got = fused_ops.nucleus_sample(x, torch.ones(3), torch.tensor([0, 0, 3]), torch.tensor([0.5, 0.5, 1.0]),
                                   torch.full((3,), 0.5, dtype=torch.float64))
    assert got.tolist() == [-1, -1, -1]
