"""The AMX cascade kernel (bf16, CPUs with AMX) equals per-request attention on random paged layouts.

Skipped where the kernel cannot run (no AMX, no gcc): `kernel_unavailable()` says why. Its fallbacks
(another dtype, a sliding window, an unsupported head_dim) are TorchCascadeBackend and are checked anywhere.
"""

import numpy as np
import pytest
import torch

from flock.attention import make_backend
from flock.attention.amx import AmxCascadeBackend, AmxMetadata, kernel_unavailable
from flock.attention.base import StepLayout
from flock.attention.cascade import CascadeMetadata, TorchCascadeBackend
from flock.model.config import ModelConfig
from tests.attention import test_backends as tb

needs_kernel = pytest.mark.skipif(kernel_unavailable() is not None, reason=f"AMX kernel: {kernel_unavailable()}")


@pytest.fixture(params=[(4, 32), (16, 64), (8, 128)], ids=["bs4-d32", "bs16-d64", "bs8-d128"])
def shape(request, monkeypatch):
    bs, head_dim = request.param
    monkeypatch.setattr(tb, "BS", bs)
    monkeypatch.setattr(tb, "HEAD_DIM", head_dim)
    return bs, head_dim


@needs_kernel
@pytest.mark.parametrize("layout_name", [*tb.LAYOUTS, "long"])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 1), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
def test_bf16_equals_per_request_attention(shape, layout_name, heads, kv_heads):
    bs, _ = shape
    rng = np.random.default_rng(len(layout_name) * 7 + heads)
    layout = tb.long_layout(rng, bs) if layout_name == "long" else tb.random_layout(rng, *tb.LAYOUTS[layout_name])
    q, k, v, k_cache, v_cache = tb.fused_inputs(layout, heads, kv_heads, torch.bfloat16, heads, 2000)
    out, meta, kc, vc = tb.run_backend("amx", tb.config(heads, kv_heads), layout, q, k, v, k_cache, v_cache)
    assert isinstance(meta, AmxMetadata), "the kernel path was not taken"
    assert (meta.num_partial > 0) == (layout_name in ("several groups", "one big group", "long"))
    expected = tb.reference(q, kc, vc, layout, kv_heads)
    # the only rounding beyond the output's: P in bf16 before P V, as in PyTorch's bf16 kernel (same bound)
    assert tb.half_ulp_excess(out, expected) <= 4e-3
    torch_out = tb.run_backend("torch", tb.config(heads, kv_heads), layout, q, k, v, k_cache, v_cache)[0]
    assert tb.half_ulp_excess(out, expected) <= tb.half_ulp_excess(torch_out, expected) + 2e-3


@needs_kernel
def test_one_unit_covers_several_heads_and_wide_rows(monkeypatch):
    """16 KV heads of dim 32 (two runs of the kernel's 512-element head span) and a group whose stacked rows
    exceed one block of query tiles (9 members x 10 tokens x 8 query heads per KV head)."""
    monkeypatch.setattr(tb, "BS", 8)
    monkeypatch.setattr(tb, "HEAD_DIM", 32)
    rng = np.random.default_rng(5)
    layout = tb.random_layout(rng, [(9, 6), (3, 4)], 2)
    for heads, kv_heads in [(32, 16), (16, 2)]:
        q, k, v, k_cache, v_cache = tb.fused_inputs(layout, heads, kv_heads, torch.bfloat16, seed=1)
        out, meta, kc, vc = tb.run_backend("amx", tb.config(heads, kv_heads), layout, q, k, v, k_cache, v_cache)
        assert isinstance(meta, AmxMetadata)
        assert tb.half_ulp_excess(out, tb.reference(q, kc, vc, layout, kv_heads)) <= 4e-3


@pytest.mark.parametrize("dtype, window, head_dim", [(torch.float32, None, 64), (torch.bfloat16, 7, 64),
                                                     (torch.bfloat16, None, 8), (torch.bfloat16, None, 48)])
def test_falls_back_to_torch_cascade(monkeypatch, dtype, window, head_dim):
    monkeypatch.setattr(tb, "HEAD_DIM", head_dim)
    layout = tb.random_layout(np.random.default_rng(3), [(4, 5)], 1)
    q, k, v, k_cache, v_cache = tb.fused_inputs(layout, 4, 2, dtype)
    backend = AmxCascadeBackend(4, 2, head_dim, window, dtype)
    meta = backend.build_metadata(layout)
    assert isinstance(meta, CascadeMetadata) and not isinstance(meta, AmxMetadata)
    out = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    expected = make_backend("torch-cascade", ModelConfig("llama", 100, 4 * head_dim, 16, 1, 4, 2, head_dim,
                                                         sliding_window=window), torch.device("cpu"), dtype)
    ref = expected.forward(q, k, v, k_cache.clone(), v_cache.clone(), expected.build_metadata(layout))
    assert torch.equal(out, ref)


@needs_kernel
def test_every_attention_call_of_a_bf16_engine_run_is_exact(tmp_path, monkeypatch):
    """The kernel inside the engine (head_dim 32 model, bf16, prefix caching, chunked prefills, decodes):
    every layer's output is within the bf16 bound of exact attention on the same inputs. (Greedy tokens are
    not compared with PyTorch's bf16 attention: both round differently in the last bit, and over 8 layers
    x steps a random-weight model amplifies that into different tokens for some prompts, for either backend.)"""
    from tests import conftest
    from tests.engine.test_parity import shared_prefix_prompts

    from flock import LLM, SamplingParams

    spec = dict(conftest.HF_CONFIGS["llama"], hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setitem(conftest.HF_CONFIGS, "llama-d32", spec)
    folder = conftest.make_hf_model("llama-d32", tmp_path / "m")
    llm = LLM(str(folder), dtype="bfloat16", attention="amx", block_size=8, max_num_batched_tokens=64)
    backend = llm.engine.runner.backend
    exact = TorchCascadeBackend(backend.num_heads, backend.num_kv_heads, backend.head_dim, None, torch.float64)
    forward, build = backend.forward, backend.build_metadata
    seen = {"calls": 0, "grouped": 0, "prefill": 0, "excess": 0.0}

    def checked_build(layout):
        seen["layout"] = layout
        return build(layout)

    def checked_forward(q, k, v, k_cache, v_cache, meta):
        assert isinstance(meta, AmxMetadata)
        out = forward(q, k, v, k_cache, v_cache, meta)  # writes k, v into the caches first
        layout = seen["layout"]
        ref = exact.forward(q.double(), k.double(), v.double(), k_cache.double(), v_cache.double(),
                            exact.build_metadata(layout))
        seen["excess"] = max(seen["excess"], tb.half_ulp_excess(out, ref))
        seen["calls"] += 1
        seen["grouped"] += meta.num_partial > 0
        seen["prefill"] += bool((layout.query_lens > 1).any())
        return out

    monkeypatch.setattr(backend, "build_metadata", checked_build)
    monkeypatch.setattr(backend, "forward", checked_forward)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in shared_prefix_prompts(seed=7)], params, use_tqdm=False)
    assert seen["calls"] > 0 and seen["grouped"] > 0 and seen["prefill"] > 0
    assert seen["excess"] <= 4e-3


@pytest.mark.parametrize("broken", ["no AMX", "no compiler"])
def test_an_unusable_kernel_leaves_torch_cascade(monkeypatch, tmp_path, broken):
    from flock import native
    from flock.attention import amx

    if broken == "no AMX":
        monkeypatch.setattr(native, "cpu_flags", lambda: {"avx512f"})
    else:
        monkeypatch.setattr(native, "cpu_flags", lambda: set(native.ISAS["amx"].cpu_flags))
        monkeypatch.setenv("FLOCK_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("PATH", str(tmp_path))  # no gcc on it
    amx.KERNEL.clear()
    try:
        reason = kernel_unavailable()
        assert reason and ("lacks" in reason if broken == "no AMX" else "could not build" in reason)
        cfg = tb.config(4, 2)
        cfg.head_dim = 64
        assert not isinstance(make_backend("auto", cfg, torch.device("cpu"), torch.bfloat16), AmxCascadeBackend)
        layout = tb.random_layout(np.random.default_rng(1), [(3, 4)], 1)
        assert not isinstance(AmxCascadeBackend(4, 2, 64, None, torch.bfloat16).build_metadata(layout), AmxMetadata)
    finally:
        amx.KERNEL.clear()
