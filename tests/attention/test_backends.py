"""Every attention backend equals plain per-request attention on random paged layouts."""

import numpy as np
import pytest
import torch

from flock.attention import make_backend
from flock.attention.base import StepLayout
from flock.attention.sharing import find_prefix_groups
from flock.model.config import ModelConfig

BS = 4
HEAD_DIM = 8


def config(heads: int, kv_heads: int, window=None, softcap=None) -> ModelConfig:
    return ModelConfig("llama", 100, heads * HEAD_DIM, 16, 1, heads, kv_heads, HEAD_DIM, sliding_window=window,
                       attn_logit_softcapping=softcap)


def random_layout(rng: np.random.Generator, groups: list[tuple[int, int]], singles: int, num_blocks: int = 400):
    """groups: (members, shared prefix blocks). Each request gets its own tail, a computed length past the
    prefix and a query of 1 token (decode) or a chunk. Physical blocks are shuffled."""
    free = list(rng.permutation(num_blocks))
    tables, starts, qlens = [], [], []
    for members, prefix_blocks in groups + [(1, 0)] * singles:
        prefix = [free.pop() for _ in range(prefix_blocks)]
        for _ in range(members):
            start = prefix_blocks * BS + int(rng.integers(0, 9))
            qlen = 1 if rng.random() < 0.6 else int(rng.integers(2, 11))
            own = -(-(start + qlen) // BS) - prefix_blocks
            tables.append(np.array(prefix + [free.pop() for _ in range(own)], dtype=np.int64))
            starts.append(start)
            qlens.append(qlen)
    order = rng.permutation(len(tables))
    tables = [tables[i] for i in order]
    starts, qlens = np.array(starts)[order], np.array(qlens)[order]
    query_start = np.concatenate([[0], np.cumsum(qlens)])
    slots = np.concatenate([t[np.arange(s, s + q) // BS] * BS + np.arange(s, s + q) % BS
                            for t, s, q in zip(tables, starts, qlens)])
    return StepLayout(query_start, starts + qlens, tables, BS, torch.from_numpy(slots))


def reference(q, k_cache, v_cache, layout: StepLayout, kv_heads: int, window=None, softcap=None):
    """Per-request attention, one token at a time, in float64 (scores capped as Gemma 2's with `softcap`)."""
    out = torch.empty_like(q, dtype=torch.float64)
    g = q.shape[1] // kv_heads
    for i in range(len(layout.seq_lens)):
        ctx = layout.context_slots(i)
        keys = k_cache.view(-1, kv_heads, HEAD_DIM)[torch.from_numpy(ctx)].double().repeat_interleave(g, 1)
        vals = v_cache.view(-1, kv_heads, HEAD_DIM)[torch.from_numpy(ctx)].double().repeat_interleave(g, 1)
        first = int(layout.seq_lens[i] - layout.query_lens[i])
        for j, t in enumerate(range(layout.query_start[i], layout.query_start[i + 1])):
            pos = first + j
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,khd->hk", q[t].double(), keys[lo : pos + 1]) * HEAD_DIM**-0.5
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[t] = torch.einsum("hk,khd->hd", scores.softmax(-1), vals[lo : pos + 1])
    return out


def fused_inputs(layout: StepLayout, heads: int, kv_heads: int, dtype, seed: int = 0, num_blocks: int = 400):
    """q, k, v as views of one fused projection (strided like a model's), and random caches."""
    gen = torch.Generator().manual_seed(seed)
    n = int(layout.query_start[-1])
    qkv = torch.randn(n, heads + 2 * kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    caches = [torch.randn(num_blocks, BS, kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
              for _ in range(2)]
    return q, k, v, *caches


def run_backend(name, cfg, layout, q, k, v, k_cache, v_cache):
    backend = make_backend(name, cfg, torch.device("cpu"), q.dtype)
    meta = backend.build_metadata(layout)
    kc, vc = k_cache.clone(), v_cache.clone()
    return backend.forward(q, k, v, kc, vc, meta), meta, kc, vc


def long_layout(rng: np.random.Generator, bs: int) -> StepLayout:
    """Contexts over several of the kernel's 128-position chunks: a fresh 300-token prefill (causal rows
    that see nothing of later chunks), a 3-member group on a 70-block prefix with a 37-token chunk and
    decodes, and a decode with 499 tokens of context."""
    free = list(rng.permutation(2000))
    tables, starts, qlens = [], [], []

    def add(blocks, start, qlen):
        tables.append(np.array(blocks, dtype=np.int64))
        starts.append(start)
        qlens.append(qlen)

    add([free.pop() for _ in range(-(-300 // bs))], 0, 300)
    prefix = [free.pop() for _ in range(70)]
    for qlen in (1, 37, 1):
        start = 70 * bs + int(rng.integers(0, 50))
        add(prefix + [free.pop() for _ in range(-(-(start + qlen) // bs) - 70)], start, qlen)
    add([free.pop() for _ in range(-(-500 // bs))], 499, 1)
    starts, qlens = np.array(starts), np.array(qlens)
    slots = np.concatenate([t[np.arange(s, s + q) // bs] * bs + np.arange(s, s + q) % bs
                            for t, s, q in zip(tables, starts, qlens)])
    return StepLayout(np.concatenate([[0], np.cumsum(qlens)]), starts + qlens, tables, bs, torch.from_numpy(slots))


def half_ulp_excess(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest error beyond half a bf16 unit in the last place of the exact value (the output rounding)."""
    exponent = torch.frexp(expected.abs().clamp_min(1e-30))[1]
    return ((out.double() - expected).abs() - torch.ldexp(torch.ones_like(expected), exponent - 9)).max().item()


LAYOUTS = {
    "several groups": ([(4, 3), (3, 5), (2, 2)], 2),
    "one big group": ([(9, 6)], 0),
    "group of one": ([(1, 4)], 1),
    "no sharing": ([], 5),
}


@pytest.mark.parametrize("backend", ["torch", "torch-cascade"])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_backend_equals_per_request_attention(backend, layout_name, heads, kv_heads, dtype, tol):
    rng = np.random.default_rng(abs(hash((backend, layout_name, heads))) % 2**32)
    layout = random_layout(rng, *LAYOUTS[layout_name])
    torch.manual_seed(0)
    n_tokens = int(layout.query_start[-1])
    q = torch.randn(n_tokens, heads, HEAD_DIM, dtype=dtype)
    k = torch.randn(n_tokens, kv_heads, HEAD_DIM, dtype=dtype)
    v = torch.randn(n_tokens, kv_heads, HEAD_DIM, dtype=dtype)
    k_cache = torch.randn(400, BS, kv_heads, HEAD_DIM, dtype=dtype)
    v_cache = torch.randn(400, BS, kv_heads, HEAD_DIM, dtype=dtype)
    out, meta, kc, vc = run_backend(backend, config(heads, kv_heads), layout, q, k, v, k_cache, v_cache)
    expected = reference(q, kc, vc, layout, kv_heads)
    assert (out.double() - expected).abs().max().item() <= tol
    if backend == "torch-cascade":
        sharing = layout_name in ("several groups", "one big group")
        assert bool(meta.groups) == sharing


def test_sliding_window_disables_sharing_but_stays_exact():
    rng = np.random.default_rng(3)
    layout = random_layout(rng, [(4, 5)], 1)
    n = int(layout.query_start[-1])
    q, k, v = torch.randn(n, 4, HEAD_DIM), torch.randn(n, 2, HEAD_DIM), torch.randn(n, 2, HEAD_DIM)
    caches = torch.randn(400, BS, 2, HEAD_DIM), torch.randn(400, BS, 2, HEAD_DIM)
    for name in ("torch", "torch-cascade"):
        out, meta, kc, vc = run_backend(name, config(4, 2, window=7), layout, q, k, v, *caches)
        assert (out.double() - reference(q, kc, vc, layout, 2, window=7)).abs().max() <= 1e-5


@pytest.mark.parametrize("window", [None, 7])
def test_capped_scores_stay_exact(window):
    """Gemma 2's softcap on every score (prefix groups' and per-request parts' alike, then merged), with and
    without a window, on both PyTorch backends (the fresh causal chunk no longer on PyTorch's fused kernel)."""
    rng = np.random.default_rng(4)
    layout = random_layout(rng, [(3, 4), (2, 2)], 2)
    n = int(layout.query_start[-1])
    q, k, v = 2 * torch.randn(n, 4, HEAD_DIM), 2 * torch.randn(n, 2, HEAD_DIM), torch.randn(n, 2, HEAD_DIM)
    caches = 2 * torch.randn(400, BS, 2, HEAD_DIM), torch.randn(400, BS, 2, HEAD_DIM)
    for name in ("torch", "torch-cascade"):
        out, meta, kc, vc = run_backend(name, config(4, 2, window, softcap=1.5), layout, q, k, v, *caches)
        expected = reference(q, kc, vc, layout, 2, window, softcap=1.5)
        assert (out.double() - expected).abs().max() <= 1e-5
        assert (out.double() - reference(q, kc, vc, layout, 2, window)).abs().max() > 0.05  # the cap matters


def test_groups_maximise_saved_prefix_reads():
    t = lambda *b: np.array(b)  # noqa: E731
    # A, B share 6 blocks; C, D share 6 others; all four share block 1 only
    tables = [t(1, 2, 3, 4, 5, 6, 7), t(1, 2, 3, 4, 5, 6, 8), t(1, 9, 10, 11, 12, 13, 14), t(1, 9, 10, 11, 12, 13, 15)]
    usable = np.array([7, 7, 7, 7])
    groups = find_prefix_groups(tables, usable, min_blocks=1)
    assert sorted((sorted(g.members), g.num_blocks) for g in groups) == [([0, 1], 6), ([2, 3], 6)]
    # all four sharing 5 blocks beats two pairs sharing 6: 3*5 > 2*6
    tables = [t(1, 2, 3, 4, 5, 6, 7), t(1, 2, 3, 4, 5, 6, 8), t(1, 2, 3, 4, 5, 9), t(1, 2, 3, 4, 5, 9)]
    groups = find_prefix_groups(tables, np.array([7, 7, 6, 6]), min_blocks=1)
    assert [(sorted(g.members), g.num_blocks) for g in groups] == [([0, 1, 2, 3], 5)]
    # usable blocks cap the depth (a block computed in this step is not a shared prefix yet)
    groups = find_prefix_groups(tables[:2], np.array([7, 3]), min_blocks=2)
    assert [(sorted(g.members), g.num_blocks) for g in groups] == [([0, 1], 3)]
    assert find_prefix_groups(tables[:2], np.array([7, 1]), min_blocks=2) == []


def test_groups_equal_those_of_tables_sorted_and_compared_as_tuples():
    """The tables are sorted as byte strings and compared as one array; the groups are those of Python tuples."""
    from flock.attention import sharing

    rng = np.random.default_rng(5)
    for _ in range(300):
        trunks = [rng.integers(0, 5000, size=int(rng.integers(1, 12))) for _ in range(3)]
        tails = [rng.integers(5000, 9999, size=int(rng.integers(0, 3))) for _ in range(int(rng.integers(0, 24)))]
        tables = [np.concatenate([trunks[int(rng.integers(3))][: int(rng.integers(13))], tail]).astype(
            rng.choice(["i4", "i8"])) for tail in tails]
        usable = np.array([int(rng.integers(len(t) + 1)) for t in tables], dtype=np.int64)
        rows = sorted((i for i in range(len(tables)) if usable[i] >= 2), key=lambda i: tuple(tables[i][: usable[i]]))
        lcp = [next((d for d, (x, y) in enumerate(zip(tables[a][: usable[a]], tables[b][: usable[b]])) if x != y),
                    min(usable[a], usable[b])) for a, b in zip(rows, rows[1:])]
        expected = sharing._best(rows, lcp, 0, len(rows) - 1, 2)[1] if len(rows) > 1 else []
        assert find_prefix_groups(tables, usable) == expected


def test_sample_rows_with_drafts():
    """A request verifying drafts samples its last count rows; sampled_only keeps them as its queries."""
    layout = StepLayout(query_start=np.array([0, 5, 6, 9]), seq_lens=np.array([5, 40, 30]),
                        block_tables=[np.arange(3)] * 3, block_size=16, slot_mapping=torch.arange(9),
                        sampled=np.array([1, 2]), sample_counts=np.array([1, 3]))
    assert layout.sample_rows.tolist() == [5, 6, 7, 8]
    only, rows = layout.sampled_only()
    assert rows.tolist() == [5, 6, 7, 8] and only.query_start.tolist() == [0, 1, 4]
    assert only.seq_lens.tolist() == [40, 30] and only.slot_mapping.tolist() == [5, 6, 7, 8]
    layout.sample_counts = None
    assert layout.sample_rows.tolist() == [5, 8]
