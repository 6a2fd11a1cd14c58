"""The fused CPU kernel (every ISA path this machine runs, bf16 and fp32) equals per-request attention on random
paged layouts; its fallbacks are TorchCascadeBackend bit for bit; inside the engine it keeps the invariant.

Paths this CPU lacks are skipped (`isa_paths()` lists the ones it runs).
"""

import dataclasses

import numpy as np
import pytest
import torch

from flock import native
from flock.attention import cpu, make_backend
from flock.attention.base import StepLayout
from flock.attention.cascade import CascadeMetadata, TorchCascadeBackend
from flock.attention.cpu import CpuCascadeBackend, CpuMetadata, plan_segments
from flock.attention.segments import DIRECT, PARTIAL, PREFIX, build_segments
from flock.model.config import ModelConfig
from tests.attention import test_backends as tb
from tests.engine.test_parity import references  # noqa: F401 (a fixture)

# every path, and the amx path with its tiles emulated (on any AVX2 CPU; and on AVX512-BF16 ones with the amx
# build's own AVX-512 code); a path that cannot run here says why
EMULATED = (cpu.EMULATED_AMX, cpu.EMULATED_AMX_512)
PATHS = [p if (why := cpu.kernel_unavailable(p)) is None else pytest.param(p, marks=pytest.mark.skip(reason=why))
         for p in (*cpu.PATHS, *EMULATED)]
SHAPES = {"bs4-d32": (4, 32), "bs16-d64": (16, 64), "bs8-d128": (8, 128), "bs8-d80": (8, 80)}
FP32_TOL = 1e-5
_references: dict = {}


@pytest.fixture
def shape(request, monkeypatch):
    bs, head_dim = SHAPES[request.param]
    monkeypatch.setattr(tb, "BS", bs)
    monkeypatch.setattr(tb, "HEAD_DIM", head_dim)
    return bs, head_dim


def case(layout_name: str, heads: int, kv_heads: int, dtype, bs: int, head_dim: int):
    """Inputs and the float64 reference, computed once for all ISA paths."""
    key = (layout_name, heads, kv_heads, dtype, bs, head_dim)
    if key not in _references:
        rng = np.random.default_rng(len(layout_name) * 7 + heads)
        layout = tb.long_layout(rng, bs) if layout_name == "long" else tb.random_layout(rng, *tb.LAYOUTS[layout_name])
        q, k, v, k_cache, v_cache = tb.fused_inputs(layout, heads, kv_heads, dtype, heads, 2000)
        _, _, kc, vc = tb.run_backend("torch", tb.config(heads, kv_heads), layout, q, k, v, k_cache, v_cache)
        _references[key] = layout, (q, k, v, k_cache, v_cache), tb.reference(q, kc, vc, layout, kv_heads)
    return _references[key]


def check(out: torch.Tensor, expected: torch.Tensor, dtype) -> None:
    if dtype == torch.bfloat16:  # beyond the output's rounding only P in bf16 (vdpbf16ps), as PyTorch's kernel
        assert tb.half_ulp_excess(out, expected) <= 4e-3
    else:
        assert (out.double() - expected).abs().max().item() <= FP32_TOL


def run_cpu(isa, monkeypatch, heads, kv_heads, layout, inputs):
    if isa in EMULATED:  # no FLOCK_CPU_ISA for it: a test path
        backend = CpuCascadeBackend(heads, kv_heads, inputs[0].shape[-1], None, inputs[0].dtype, isa=isa)
    else:
        monkeypatch.setenv(native.ISA_ENV, isa)
        backend = make_backend("cpu", tb.config(heads, kv_heads), torch.device("cpu"), inputs[0].dtype)
    assert isinstance(backend, CpuCascadeBackend) and backend.isa == isa
    meta = backend.build_metadata(layout)
    assert isinstance(meta, CpuMetadata), "the kernel path was not taken"
    q, k, v, k_cache, v_cache = inputs
    return backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta), meta


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 1), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("shape", list(SHAPES), indirect=True)
def test_long_contexts_groups_and_fresh_prefills(monkeypatch, isa, dtype, heads, kv_heads, shape):
    """A fresh 300-token prefill, a group on a 70-block prefix with a 37-token chunk and decodes, a decode
    with 499 tokens of context: several of the kernel's chunks, causal, grouped and not."""
    layout, inputs, expected = case("long", heads, kv_heads, dtype, *shape)
    out, meta = run_cpu(isa, monkeypatch, heads, kv_heads, layout, inputs)
    assert len(meta.merge_tokens) > 0
    check(out, expected, dtype)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", [0, 2], ids=["repacked", "in-place"])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2)], ids=["one-row", "two-rows"])
@pytest.mark.parametrize("shape", list(SHAPES), indirect=True)
def test_decode_units_read_in_place_or_repacked(monkeypatch, isa, rows, heads, kv_heads, shape):
    """Units of one or two rows (decodes with one or two query heads a KV head) read bf16 K and V rows in place
    where `direct_rows` lets them (the vdpbf16ps builds), else repacked: the same attention either way, whatever
    this CPU's own choice."""
    monkeypatch.setattr(cpu, "direct_rows", lambda: rows)
    layout, inputs, expected = case("long", heads, kv_heads, torch.bfloat16, *shape)
    out, _ = run_cpu(isa, monkeypatch, heads, kv_heads, layout, inputs)
    check(out, expected, torch.bfloat16)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", ["bs16-d64"], indirect=True)
def test_a_packed_once_segment_whose_last_unit_is_one_token(monkeypatch, isa, dtype, shape):
    """A prefill segment of SHARED_BLOCKS row blocks or more has each chunk packed once for all its units; its
    last unit, one token's rows (read in place, as a decode's), reads K and V by its own row offsets all the same
    (it read stale ones: the last token of such a prefill came out wrong in bf16). A 205-token prefill, and a
    request computing 3 units and one token more after 8 cached blocks of it, in one step."""
    bs, heads, kv_heads = shape[0], 16, 8
    unit_rows = cpu.kernel_library(isa).flock_cpu_unit_rows()
    new = (3 * unit_rows + 2) // (heads // kv_heads)
    table_a, table_b = np.arange(13), np.concatenate([np.arange(8), 100 + np.arange(-(-(128 + new) // bs) - 8)])
    slots = [table_a[p // bs] * bs + p % bs for p in range(205)]
    slots += [table_b[p // bs] * bs + p % bs for p in range(128, 128 + new)]
    layout = StepLayout(query_start=np.array([0, 205, 205 + new]), seq_lens=np.array([205, 128 + new]),
                        block_tables=[table_a, table_b], block_size=bs, slot_mapping=torch.tensor(slots))
    inputs = tb.fused_inputs(layout, heads, kv_heads, dtype)
    out, _ = run_cpu(isa, monkeypatch, heads, kv_heads, layout, inputs)
    q, k, v, k_cache, v_cache = inputs
    _, _, kc, vc = tb.run_backend("torch", tb.config(heads, kv_heads), layout, q, k, v, k_cache, v_cache)
    check(out, tb.reference(q, kc, vc, layout, kv_heads), dtype)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("layout_name", list(tb.LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (8, 1)], ids=["gqa1", "gqa8"])
@pytest.mark.parametrize("shape", ["bs4-d32"], indirect=True)
def test_random_layouts(monkeypatch, isa, layout_name, dtype, heads, kv_heads, shape):
    layout, inputs, expected = case(layout_name, heads, kv_heads, dtype, *shape)
    out, meta = run_cpu(isa, monkeypatch, heads, kv_heads, layout, inputs)
    assert (len(meta.merge_tokens) > 0) == (layout_name in ("several groups", "one big group"))
    check(out, expected, dtype)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("layout_name", ["several groups", "no sharing"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 1)], ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("shape", ["bs4-d32"], indirect=True)
def test_a_nan_stays_nan(monkeypatch, isa, layout_name, dtype, heads, kv_heads, shape):
    """A NaN in a query comes out as NaN in its row and head only, as PyTorch's attention gives it, whether the
    row's output is written directly or merged from partials: never a silent 0 or a finite row."""
    layout = tb.random_layout(np.random.default_rng(5), *tb.LAYOUTS[layout_name])
    q, k, v, k_cache, v_cache = tb.fused_inputs(layout, heads, kv_heads, dtype, 7)
    for token in (0, int(layout.query_start[-1]) - 1):
        q[token, heads - 1, 3] = float("nan")
    out, meta = run_cpu(isa, monkeypatch, heads, kv_heads, layout, (q, k, v, k_cache, v_cache))
    _, _, kc, vc = tb.run_backend("torch", tb.config(heads, kv_heads), layout, q, k, v, k_cache, v_cache)
    expected = tb.reference(q, kc, vc, layout, kv_heads)
    assert (len(meta.merge_tokens) > 0) == (layout_name == "several groups") and expected.isnan().any()
    assert torch.equal(out.isnan(), expected.isnan())


def test_long_queries_join_no_group():
    """A request with more than MAX_GROUP_QUERY new tokens attends alone (its prefill fills the tiles by itself);
    the decodes on its prefix still read it once, as a group."""
    layout = tb.long_layout(np.random.default_rng(3), 16)  # a group of 1-, 37- and 1-token queries on 70 blocks
    kinds = {}
    for limit in (cpu.MAX_GROUP_QUERY, None):
        s = build_segments(layout, 4, 2, limit)
        kinds[limit] = sorted(zip(s.kind.tolist(), (s.rows // 4).tolist()))
    assert (PREFIX, 2) in kinds[cpu.MAX_GROUP_QUERY] and (DIRECT, 37) in kinds[cpu.MAX_GROUP_QUERY]
    assert (PREFIX, 39) in kinds[None] and (PARTIAL, 37) in kinds[None]


def test_plan_splits_a_segment_that_would_keep_one_thread_busy():
    """One decode on a long context and one KV head: 8 threads get it as pieces of whole chunks; shorter
    segments stay whole."""
    bs = 16
    tables = [np.arange(40), np.arange(40, 42)]
    seq = np.array([640, 20])
    layout = tb.StepLayout(np.array([0, 1, 2]), seq, tables, bs, torch.zeros(2, dtype=torch.int64))
    s = build_segments(layout, 4, 2)
    segs, slots, offsets, tokens, num_slots = plan_segments(s, 4, 1, threads=8, unit_rows=128, chunk=64)
    long = segs[segs[:, 4] > 20]
    assert len(long) > 2 and (long[:, 3] % 64 == 0).all() and long[0, 3] == 0 and long[-1, 4] == 640
    assert (long[1:, 3] == long[:-1, 4]).all()  # consecutive, whole chunks
    assert sorted(long[:, 6]) == list(range(len(long)))  # each its own slot
    assert list(tokens) == [0] and offsets.tolist() == [0, len(long)] and num_slots == len(long)
    assert segs[segs[:, 4] == 20, 6].tolist() == [-1]  # the short decode writes its output directly
    single = plan_segments(s, 4, 1, threads=1, unit_rows=128, chunk=64)[0]
    assert len(single) == 2


def nested_layout(rng: np.random.Generator, bs: int) -> StepLayout:
    """Requests in families whose prefixes nest (all of a family share its first blocks, subsets more), some with
    the same tables as another, queries of 1 token to chunks past MAX_GROUP_QUERY, physical blocks shuffled."""
    free = list(rng.permutation(5000))
    tables, starts, qlens = [], [], []
    for _ in range(int(rng.integers(0, 4))):
        root = [free.pop() for _ in range(int(rng.integers(1, 6)))]
        for _ in range(int(rng.integers(1, 4))):
            branch = root + [free.pop() for _ in range(int(rng.integers(0, 4)))]
            for _ in range(int(rng.integers(1, 5))):
                start = len(branch) * bs + int(rng.integers(-bs, 2 * bs))
                qlen = int(rng.choice([1, 1, 2, 7, 16, 17, 40]))
                own = max(0, -(-(start + qlen) // bs) - len(branch))
                tables.append(np.array(branch[: -(-(start + qlen) // bs)] + [free.pop() for _ in range(own)]))
                starts.append(max(start, 0)), qlens.append(qlen)
    for _ in range(int(rng.integers(0 if tables else 1, 4))):  # requests that share nothing
        start, qlen = int(rng.integers(0, 300)), int(rng.choice([1, 5, 64]))
        tables.append(np.array([free.pop() for _ in range(-(-(start + qlen) // bs))]))
        starts.append(start), qlens.append(qlen)
    order = rng.permutation(len(tables))
    starts, qlens = np.array(starts)[order], np.array(qlens)[order]
    query_start = np.concatenate([[0], np.cumsum(qlens)])
    return StepLayout(query_start, starts + qlens, [tables[i].astype(np.int64) for i in order], bs,
                      torch.zeros(int(query_start[-1]), dtype=torch.int64))


def test_the_plan_in_c_is_the_numpy_plan():
    """flock_cpu_plan gives the arrays build_segments and plan_segments give, on nested groups, identical tables,
    long queries and any thread count (which decides the pieces)."""
    rng = np.random.default_rng(5)
    backend = CpuCascadeBackend(8, 2, 64, None, torch.float32)
    lib = cpu.kernel_library(backend.isa)
    threads = torch.get_num_threads()
    try:
        for case in range(300):
            bs = int(rng.choice([1, 4, 16]))
            layout = nested_layout(rng, bs)
            torch.set_num_threads(int(rng.choice([1, 2, 3, 8])))
            got = backend._plan_in_c(lib, layout, layout.slot_mapping, 4)
            s = build_segments(layout, 4, backend.min_prefix_blocks, cpu.MAX_GROUP_QUERY)
            segs, slots, offsets, merged, num_slots = plan_segments(s, 4, 2, torch.get_num_threads(),
                                                                    lib.flock_cpu_unit_rows(), lib.flock_cpu_chunk())
            want = (segs, s.tokens, s.positions, s.tables, offsets, slots, merged)
            have = (got.segs, got.tokens, got.positions, got.tables, got.merge_offsets, got.merge_slots,
                    got.merge_tokens)
            for name, a, b in zip(("segs", "tokens", "positions", "tables", "offsets", "slots", "merged"), have, want):
                assert np.array_equal(a.numpy(), np.asarray(b, dtype=np.int32)), f"case {case}: {name}"
            assert got.num_slots == num_slots, f"case {case}"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_split_segments_merge_exactly(monkeypatch, dtype):
    """With 4 threads and one KV head, a group's long prefix and a long decode are split by KV range."""
    monkeypatch.setattr(tb, "BS", 8)
    monkeypatch.setattr(tb, "HEAD_DIM", 64)
    rng = np.random.default_rng(11)
    layout = tb.random_layout(rng, [(2, 100)], 1, num_blocks=400)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        q, k, v, k_cache, v_cache = tb.fused_inputs(layout, 4, 1, dtype, 3, 400)
        out, meta = run_cpu(cpu.chosen_isa(), monkeypatch, 4, 1, layout, (q, k, v, k_cache, v_cache))
    finally:
        torch.set_num_threads(threads)
    assert meta.num_slots > 2 * 2  # more partials than the group's two per token
    _, _, kc, vc = tb.run_backend("torch", tb.config(4, 1), layout, q, k, v, k_cache, v_cache)
    check(out, tb.reference(q, kc, vc, layout, 1), dtype)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_write_equals_index_copy(monkeypatch, isa, dtype):
    """The kernel's KV write (k and v as strided views of a fused qkv output) stores what write_kv stores; a cache
    it cannot address row by row goes through write_kv."""
    from flock.attention.base import write_kv

    torch.manual_seed(0)
    tokens, heads, kv_heads, d, blocks, bs = 37, 8, 2, 64, 12, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(dtype)
    _, k, v = qkv.view(tokens, -1, d).split([heads, kv_heads, kv_heads], 1)
    slots = torch.randperm(blocks * bs)[:tokens]
    backend = CpuCascadeBackend(heads, kv_heads, d, None, dtype, isa=isa)
    caches = [torch.zeros(blocks, bs, kv_heads, d, dtype=dtype) for _ in range(4)]
    with monkeypatch.context() as m:
        m.setattr(cpu, "write_kv", None)  # the kernel's own write, not the fallback
        backend._write_kv(k, v, caches[0], caches[1], slots)
    write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    strided = [torch.zeros(blocks, bs, kv_heads, 2 * d, dtype=dtype)[..., :d] for _ in range(2)]
    backend._write_kv(k, v, *strided, slots)
    assert torch.equal(strided[0], caches[2]) and torch.equal(strided[1], caches[3])


def windowed_layout(rng: np.random.Generator, window: int, bs: int) -> StepLayout:
    """Decodes of a 3-member group on a 6-block prefix, a lone decode 3 windows deep, one just within the window,
    a fresh prefill within it, a fresh prefill of three windows, a 37-token chunk two windows in and 3 tokens (a
    unit of few rows, as drafts are) 3 windows in."""
    free = list(rng.permutation(2000))
    prefix = [free.pop() for _ in range(6)]
    specs = [(prefix, 6 * bs + int(rng.integers(0, 9)), 1) for _ in range(3)]
    specs += [([], 3 * window + 5, 1), ([], window - 3, 1), ([], 0, min(window, 7)), ([], 0, 3 * window),
              ([], 2 * window + 3, 37), ([], 3 * window + 9, 3)]
    tables, starts, qlens = [], [], []
    for shared, start, qlen in specs:
        own = -(-(start + qlen) // bs) - len(shared)
        tables.append(np.array(shared + [free.pop() for _ in range(own)], dtype=np.int64))
        starts.append(start)
        qlens.append(qlen)
    starts, qlens = np.array(starts), np.array(qlens)
    slots = np.concatenate([t[np.arange(s, s + q) // bs] * bs + np.arange(s, s + q) % bs
                            for t, s, q in zip(tables, starts, qlens)])
    return StepLayout(np.concatenate([[0], np.cumsum(qlens)]), starts + qlens, tables, bs, torch.from_numpy(slots))


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [5, 20, 60, 130])
@pytest.mark.parametrize("shape", list(SHAPES), indirect=True)
def test_a_sliding_window_on_the_kernel(monkeypatch, isa, dtype, window, shape):
    """Each causal row sees the last `window` positions up to its own: decodes and prefill rows past the window
    (across the kernel's 64-position chunks and its vectors' lanes), rows within it, a grouped request whose
    context passes the window out of its group. Against the float64 reference with the window's mask."""
    bs, _ = shape
    layout = windowed_layout(np.random.default_rng(window), window, bs)
    inputs = tb.fused_inputs(layout, 4, 2, dtype, 4, 2000)
    q, k, v, k_cache, v_cache = inputs
    _, _, kc, vc = tb.run_backend("torch", tb.config(4, 2), layout, q, k, v, k_cache, v_cache)
    expected = tb.reference(q, kc, vc, layout, 2, window)
    if isa in EMULATED:
        backend = CpuCascadeBackend(4, 2, q.shape[-1], window, dtype, isa=isa)
    else:
        monkeypatch.setenv(native.ISA_ENV, isa)
        backend = make_backend("cpu", tb.config(4, 2, window), torch.device("cpu"), dtype)
    meta = backend.build_metadata(layout)
    assert isinstance(meta, CpuMetadata)
    check(backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta), expected, dtype)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("shape", ["bs4-d32", "bs8-d128"], indirect=True)
def test_capped_scores_on_the_kernel(monkeypatch, isa, dtype, window, shape):
    """Gemma 2's softcap (scaled scores x as cap tanh(x / cap)) on every path: grouped prefixes and own parts
    merged, windows, decodes and prefills; against the float64 reference with the cap (scores large enough that
    the cap changes the result)."""
    bs, _ = shape
    layout = windowed_layout(np.random.default_rng(11), 20, bs)
    q, k, v, k_cache, v_cache = tb.fused_inputs(layout, 4, 2, dtype, 5, 2000)
    q = (3 * q.double()).to(dtype)
    _, _, kc, vc = tb.run_backend("torch", tb.config(4, 2), layout, q, k, v, k_cache, v_cache)
    expected = tb.reference(q, kc, vc, layout, 2, window, softcap=2.0)
    if isa in EMULATED:
        backend = CpuCascadeBackend(4, 2, q.shape[-1], window, dtype, isa=isa, softcap=2.0)
    else:
        monkeypatch.setenv(native.ISA_ENV, isa)
        backend = make_backend("cpu", tb.config(4, 2, window, softcap=2.0), torch.device("cpu"), dtype)
    meta = backend.build_metadata(layout)
    assert isinstance(meta, CpuMetadata) and (window is not None or len(meta.merge_tokens) > 0)
    check(backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta), expected, dtype)
    assert (expected - tb.reference(q, kc, vc, layout, 2, window)).abs().max() > 0.05


@pytest.mark.parametrize("dtype, window, head_dim", [(torch.float64, None, 64), (torch.float64, 7, 64),
                                                     (torch.float32, None, 8), (torch.bfloat16, None, 40)])
def test_falls_back_to_torch_cascade(monkeypatch, dtype, window, head_dim):
    monkeypatch.setattr(tb, "HEAD_DIM", head_dim)
    layout = tb.random_layout(np.random.default_rng(3), [(4, 5)], 1)
    q, k, v, k_cache, v_cache = tb.fused_inputs(layout, 4, 2, dtype)
    backend = CpuCascadeBackend(4, 2, head_dim, window, dtype)
    meta = backend.build_metadata(layout)
    assert isinstance(meta, CascadeMetadata) and not isinstance(meta, CpuMetadata)
    out = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    cfg = ModelConfig("llama", 100, 4 * head_dim, 16, 1, 4, 2, head_dim, sliding_window=window)
    expected = make_backend("torch-cascade", cfg, torch.device("cpu"), dtype)
    ref = expected.forward(q, k, v, k_cache.clone(), v_cache.clone(), expected.build_metadata(layout))
    assert torch.equal(out, ref)


def test_auto_picks_the_kernel_on_x86_cpus():
    cfg = tb.config(4, 2)
    cfg.head_dim = 64
    pick = lambda dtype: make_backend("auto", cfg, torch.device("cpu"), dtype)  # noqa: E731
    if cpu.kernel_unavailable() is None:
        assert isinstance(pick(torch.float32), CpuCascadeBackend)
        assert isinstance(pick(torch.bfloat16), CpuCascadeBackend)
    assert type(pick(torch.float64)) is TorchCascadeBackend


def test_a_path_says_why_it_cannot_run(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma"})
    assert "avx512_bf16" in cpu.kernel_unavailable("avx512bf16")
    assert "'sse9'" in cpu.kernel_unavailable("sse9")
    if cpu.kernel_unavailable() is None:
        assert cpu.kernel_unavailable("avx2") is None


@pytest.mark.parametrize("broken", ["forced path missing", "no compiler", "no AVX2"])
def test_an_unusable_kernel_leaves_torch_cascade(monkeypatch, tmp_path, broken):
    if broken == "forced path missing":
        monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma"})
        monkeypatch.setenv(native.ISA_ENV, "avx512bf16")
    elif broken == "no AVX2":
        monkeypatch.setattr(native, "cpu_flags", lambda: {"sse4_2"})
    else:
        monkeypatch.setenv("FLOCK_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("PATH", str(tmp_path))  # no gcc on it
    cpu.KERNEL.clear()
    try:
        reason = cpu.kernel_unavailable()
        expected = {"forced path missing": "lacks avx512", "no compiler": "could not build", "no AVX2": "no AVX2"}
        assert reason and expected[broken] in reason
        cfg = tb.config(4, 2)
        cfg.head_dim = 64
        assert type(make_backend("auto", cfg, torch.device("cpu"), torch.float32)) is TorchCascadeBackend
        layout = tb.random_layout(np.random.default_rng(1), [(3, 4)], 1)
        assert not isinstance(CpuCascadeBackend(4, 2, 64, None, torch.float32).build_metadata(layout), CpuMetadata)
    finally:
        cpu.KERNEL.clear()


def test_an_unknown_isa_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="FLOCK_CPU_ISA='sse9'.*avx2"):
        make_backend("cpu", tb.config(4, 2), torch.device("cpu"), torch.float32)


# every pair of the four choices' values once (a half of their 16 combinations: kv fp8 where an odd number of
# the other three take their second value)
EXACT_RUNS = [(kind, dtype, drafts, "fp8" if (kind == "mistral") ^ (dtype == torch.float32) ^ drafts else "auto")
              for kind in ("llama", "mistral") for dtype in (torch.bfloat16, torch.float32) for drafts in (False, True)]


@pytest.mark.parametrize("kind, dtype, drafts, kv", EXACT_RUNS,
                         ids=[f"{k}-{'bf16' if d == torch.bfloat16 else 'fp32'}-{'drafts' if r else 'plain'}-{v}"
                              for k, d, r, v in EXACT_RUNS])
def test_every_attention_call_of_an_engine_run_is_exact(hf_folders, monkeypatch, dtype, kind, drafts, kv):
    """The kernel inside the engine (prefix caching, chunked prefills, decodes, groups; the last layer's plan
    for the sampled rows alone, with speculative drafts a row after each draft too; Mistral's 12-token sliding
    window; an fp8 cache): every layer's output is within the bf16 bound (fp32: 1e-5) of exact attention on the
    same inputs (over what the cache holds), on every row it plans."""
    from tests.engine.test_parity import shared_prefix_prompts

    from flock import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(str(hf_folders[kind]), dtype=str(dtype).removeprefix("torch."), attention="cpu", block_size=4,
              max_num_batched_tokens=48, speculative_config=spec if drafts else None, kv_cache_dtype=kv)
    backend = llm.engine.runner.backend
    exact = TorchCascadeBackend(backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.sliding_window,
                                torch.float64, kv_dtype=None if kv == "auto" else llm.engine.runner.kv_dtype)
    forward, build = backend.forward, backend.build_metadata
    seen = {"calls": 0, "grouped": 0, "prefill": 0, "fresh": 0, "sampled_only": 0, "draft_rows": 0, "error": 0.0}

    def checked_build(layout):
        seen["layout"] = layout
        return build(layout)

    def checked_forward(q, k, v, k_cache, v_cache, meta):
        assert isinstance(meta, CpuMetadata)
        out = forward(q, k, v, k_cache, v_cache, meta)  # writes k, v into the caches first
        layout = seen["layout"]
        caches = (k_cache.double(), v_cache.double()) if kv == "auto" else (k_cache.clone(), v_cache.clone())
        ref = exact.forward(q.double(), k.double(), v.double(), *caches, exact.build_metadata(layout))
        rows = torch.from_numpy(np.unique(meta.tokens.numpy())).long()  # all, or the sampled rows' plan
        seen["sampled_only"] += len(rows) < len(q)
        seen["draft_rows"] += len(rows) < len(q) and layout.sample_counts is not None
        got, ref = out[rows], ref[rows]
        if len(rows):  # (a step of prompt chunks alone samples nothing: its last layer plans no rows)
            err = tb.half_ulp_excess(got, ref) if dtype == torch.bfloat16 else (got.double() - ref).abs().max().item()
            seen["error"] = max(seen["error"], err)
        seen["calls"] += 1
        seen["grouped"] += len(meta.merge_tokens) > 0
        seen["prefill"] += bool((layout.query_lens > 1).any())
        seen["fresh"] += bool(((layout.query_lens == layout.seq_lens) & (layout.query_lens > 1)).any())
        return out

    monkeypatch.setattr(backend, "build_metadata", checked_build)
    monkeypatch.setattr(backend, "forward", checked_forward)
    params = SamplingParams(temperature=0, max_tokens=16 if drafts else 8, ignore_eos=True)
    prompts = shared_prefix_prompts(seed=7)
    if drafts:  # repeats to draft from, admitted while others decode
        prompts = [p + p[-6:] * 3 for p in prompts]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert seen["calls"] > 0 and seen["prefill"] > 0 and seen["fresh"] > 0
    assert (seen["draft_rows"] > 0) == drafts
    assert seen["grouped"] > 0 or kind == "mistral"  # contexts past the window join no group
    assert seen["sampled_only"] > 0
    assert seen["error"] <= (4e-3 if dtype == torch.bfloat16 else FP32_TOL)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "granite", "gemma", "qwen3_moe", "mixtral",
                                  "phi3_partial", "smollm3"])
def test_float32_greedy_matches_transformers(hf_folders, references, kind):
    """Float32 with the kernel gives transformers' greedy tokens (its float64 run), also under a KV budget a
    fraction of the need (preemption and recomputation)."""
    from tests.engine.test_parity import assert_no_leak

    from flock import LLM, SamplingParams

    prompts, expected = references(kind)
    params = SamplingParams(temperature=0, max_tokens=len(expected[0]), ignore_eos=True)
    for budget in (None, 16):
        llm = LLM(str(hf_folders[kind]), dtype="float32", attention="cpu", block_size=4, num_kv_blocks=budget,
                  max_num_batched_tokens=32)
        assert isinstance(llm.engine.runner.backend, CpuCascadeBackend)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert (llm.stats()["preemptions"] > 0) == (budget is not None)
        assert_no_leak(llm)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", ["bs4-d32", "bs8-d128"], indirect=True)
def test_sampled_rows_plan_with_draft_rows(monkeypatch, isa, dtype, shape):
    """The last layer's plan for the sampled rows alone, where requests sample their last 1-3 new tokens (a row
    after each speculative draft): on every path those rows equal the float64 reference of the whole step."""
    layout, inputs, expected = case("several groups", 4, 2, dtype, *shape)
    layout = dataclasses.replace(layout, sampled=np.arange(len(layout.seq_lens)),
                                 sample_counts=np.minimum(layout.query_lens, np.arange(len(layout.seq_lens)) % 3 + 1))
    if isa in EMULATED:
        backend = CpuCascadeBackend(4, 2, inputs[0].shape[-1], None, dtype, isa=isa)
    else:
        monkeypatch.setenv(native.ISA_ENV, isa)
        backend = make_backend("cpu", tb.config(4, 2), torch.device("cpu"), dtype)
    meta = backend.build_metadata(layout)
    rows = torch.from_numpy(layout.sample_rows)
    assert meta.rows_only is not None and (layout.sample_counts > 1).any()
    q, k, v, k_cache, v_cache = inputs
    out = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta.rows_only)
    check(out[rows], expected[rows], dtype)
