"""The Triton cascade backend equals per-request attention on random paged layouts.

On a machine with CUDA (and TRITON_INTERPRET unset) the kernels are compiled and run on the GPU; elsewhere
they run on the CPU under Triton's interpreter, which must be switched on before the kernels are defined.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton_kernels is first imported
pytest.importorskip("triton")

from flock.attention.triton_cascade import TritonCascadeBackend, TritonCascadeMetadata  # noqa: E402
from flock.attention.triton_kernels import INTERPRETED  # noqa: E402
from tests.attention import test_backends as tb  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# max |error| <= atol + rtol * |expected|: bf16 outputs are rounded to 8 significant bits (and on GPUs the
# probabilities too, before the P @ V product)
TOL = {torch.float32: (1e-5, 0.0), torch.bfloat16: (2e-2, 1e-2), torch.float64: (1e-10, 0.0)}


@pytest.fixture(params=[(4, 8), (16, 16)], ids=["bs4-d8", "bs16-d16"])
def shape(request, monkeypatch):
    """Block size and head dim of test_backends' helpers: 4 and 8 (several blocks per KV tile, head dim
    padded), or 16 and 16 (one block per tile)."""
    bs, head_dim = request.param
    monkeypatch.setattr(tb, "BS", bs)
    monkeypatch.setattr(tb, "HEAD_DIM", head_dim)
    return bs, head_dim


def run_triton(heads, kv_heads, layout, q, k, v, k_cache, v_cache, window=None):
    backend = TritonCascadeBackend(heads, kv_heads, tb.HEAD_DIM, window, q.dtype)
    layout.slot_mapping = layout.slot_mapping.to(DEVICE)
    meta = backend.build_metadata(layout)
    kc, vc = k_cache.to(DEVICE), v_cache.to(DEVICE)
    out = backend.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kc, vc, meta)
    layout.slot_mapping = layout.slot_mapping.cpu()
    return out.cpu(), meta, kc.cpu(), vc.cpu()


def check(layout_name, heads, kv_heads, dtype, seed, kernel=True):
    layout = tb.random_layout(np.random.default_rng(seed), *tb.LAYOUTS[layout_name])
    q, k, v, k_cache, v_cache = tb.fused_inputs(layout, heads, kv_heads, dtype, seed)
    out, meta, kc, vc = run_triton(heads, kv_heads, layout, q, k, v, k_cache, v_cache)
    assert isinstance(meta, TritonCascadeMetadata) == kernel, "the kernel path was (not) taken"
    if kernel:
        sharing = layout_name in ("several groups", "one big group")
        assert (meta.num_groups > 0) == sharing
    expected = tb.reference(q, kc, vc, layout, kv_heads)
    atol, rtol = TOL[dtype]
    excess = ((out.double() - expected).abs() - rtol * expected.abs()).max().item()
    assert excess <= atol, f"max error beyond rtol {excess:.3g} > {atol}"


@pytest.mark.parametrize("layout_name", list(tb.LAYOUTS))
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 1), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
def test_float32_equals_per_request_attention(shape, layout_name, heads, kv_heads):
    check(layout_name, heads, kv_heads, torch.float32, seed=len(layout_name) * 7 + heads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "fp64"])
def test_other_dtypes(shape, dtype):
    # float64 runs the kernel (in float64) under the interpreter; on GPUs it takes the torch-cascade path
    check("several groups", 8, 2, dtype, seed=11, kernel=not (dtype == torch.float64 and ON_GPU))


def test_sliding_window_falls_back_to_torch_cascade():
    layout = tb.random_layout(np.random.default_rng(3), [(4, 5)], 1)
    q, k, v, k_cache, v_cache = tb.fused_inputs(layout, 4, 2, torch.float32)
    out, meta, kc, vc = run_triton(4, 2, layout, q, k, v, k_cache, v_cache, window=7)
    assert not isinstance(meta, TritonCascadeMetadata)
    assert (out.double() - tb.reference(q, kc, vc, layout, 2, window=7)).abs().max() <= 1e-5


def test_block_size_must_be_a_power_of_two():
    layout = tb.random_layout(np.random.default_rng(0), [], 2)
    layout.block_size = 6
    layout.slot_mapping = layout.slot_mapping.to(DEVICE)
    with pytest.raises(ValueError, match="power-of-two"):
        TritonCascadeBackend(2, 2, tb.HEAD_DIM, None, torch.float32).build_metadata(layout)


def test_kernels_run_compiled_on_gpu_and_interpreted_on_cpu():
    assert INTERPRETED == (not ON_GPU)


def test_importing_the_backend_does_not_import_triton():
    code = "import sys, flock.attention.triton_cascade; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_greedy_tokens_match_transformers_end_to_end(hf_folders):
    from tests.engine.test_parity import flock_greedy, hf_greedy, shared_prefix_prompts

    prompts = shared_prefix_prompts(seed=7)[:6]  # float32: on GPUs the kernel leaves float64 to torch-cascade
    got, llm = flock_greedy(hf_folders["llama"], prompts, dtype="float32", attention="triton", block_size=8,
                            device=DEVICE.type)
    assert got == hf_greedy(hf_folders["llama"], prompts, dtype=torch.float32)
    assert llm.engine.runner.backend.uses_kernel(DEVICE)
