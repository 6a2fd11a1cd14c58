"""fp8 KV caches (kv_cache_dtype fp8 / fp8_e5m2): the C kernel quantizes as the torch reference does, to the bit;
every attention path reads what the cache holds; greedy tokens equal transformers' with K and V rounded the same
way; the same memory holds nearly twice the blocks."""

import sys

import numpy as np
import pytest
import torch

from flock import LLM, SamplingParams
from flock.attention import cpu
from flock.attention.base import write_kv
from flock.attention.cpu import CpuCascadeBackend
from flock.kv import fp8
from tests.attention import test_backends as tb
from tests.attention.test_cpu_kernel import PATHS, check, run_cpu, shape  # noqa: F401 (shape: a fixture)
from tests.engine.test_parity import MAX_NEW, assert_no_leak, model_greedy, shared_prefix_prompts

FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def tie_rows(dtype: torch.dtype, dim: int = 64) -> torch.Tensor:
    """Rows holding the format's largest value (a scale of exactly 1) and values at and between its codes: every
    tie of the rounding, subnormals, and values past the largest."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    between = (finite[:-1] + finite[1:]) / 2
    values = torch.cat([finite, between, finite * 1.0001, torch.tensor([1e9, -1e9])])
    values = values[torch.randperm(len(values), generator=torch.Generator().manual_seed(0))]
    rows = torch.nn.functional.pad(values, (0, -len(values) % (dim - 1))).view(-1, dim - 1)
    return torch.cat([torch.full((len(rows), 1), torch.finfo(dtype).max), rows], 1)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_kernels_write_quantizes_as_the_reference(isa, fmt, dtype):
    """Rows over 18 orders of magnitude, a row of zeros, ties between codes: the same bytes as fp8.quantize."""
    gen = torch.Generator().manual_seed(1)
    heads, dim = 3, 64
    x = torch.randn(40, heads, dim, generator=gen) * torch.logspace(-9, 9, 40)[:, None, None]
    x[0, 0] = 0
    ties = tie_rows(FORMATS[fmt], dim)
    ties = torch.cat([ties, ties[: -len(ties) % heads]])
    x = torch.cat([x, ties.view(-1, heads, dim)]).to(dtype)
    cache_dtype = FORMATS[fmt]
    caches = [torch.zeros(len(x), 1, heads, dim + 4, dtype=cache_dtype) for _ in range(4)]
    slots = torch.randperm(len(x))
    backend = CpuCascadeBackend(heads, heads, dim, None, dtype, isa=isa)
    k, v = x, x.flip(0)
    backend._write_kv(k, v, caches[0], caches[1], slots)
    write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rows_come_back_within_the_formats_rounding(fmt):
    dtype = FORMATS[fmt]
    x = torch.randn(50, 64, dtype=torch.float64) * torch.logspace(-6, 6, 50, dtype=torch.float64)[:, None]
    back = fp8.dequantize(fp8.quantize(x, dtype), torch.float64)
    mantissa = 3 if dtype == torch.float8_e4m3fn else 2
    amax = x.abs().amax(-1, keepdim=True)
    # relative half a unit in the last place for normal codes; the subnormal step (of the scale) for the rest
    bound = torch.maximum(x.abs() * 2.0 ** -(mantissa + 1), amax / torch.finfo(dtype).max * torch.finfo(dtype).smallest_normal * 2.0 ** -mantissa)
    assert ((back - x).abs() <= bound * 1.0001).all()
    assert fp8.quantize(torch.zeros(2, 64), dtype).shape == (2, 68)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (2, 2)], ids=["gqa4", "gqa1"])
@pytest.mark.parametrize("shape", ["bs16-d64", "bs8-d80"], indirect=True)
def test_the_kernel_reads_an_fp8_cache_as_its_values(monkeypatch, isa, fmt, dtype, heads, kv_heads, shape):
    """Long contexts, a group, decodes and a fresh prefill (packed chunks, packed once, read in place) over an fp8
    cache whose rows hold subnormal codes too: exact attention over the dequantized cache, this step's tokens
    included."""
    rng = np.random.default_rng(3)
    layout = tb.long_layout(rng, shape[0])
    q, k, v, k_cache, v_cache = tb.fused_inputs(layout, heads, kv_heads, dtype, heads, 2000)
    for c in (k_cache, v_cache):  # tiny dims: codes below e4m3's smallest normal, and below e5m2's, in every row
        c[..., 1::4] *= 1e-5
        c[..., 3::4] *= 1e-9
    k_cache, v_cache = (fp8.quantize(c, FORMATS[fmt]) for c in (k_cache, v_cache))
    out, meta = run_cpu(isa, monkeypatch, heads, kv_heads, layout, (q, k, v, k_cache, v_cache))
    assert len(meta.merge_tokens) > 0
    kc, vc = k_cache.clone(), v_cache.clone()
    write_kv(k, v, kc, vc, layout.slot_mapping)
    expected = tb.reference(q, *(fp8.dequantize(c, dtype) for c in (kc, vc)), layout, kv_heads)
    check(out, expected, dtype)


@pytest.mark.parametrize("backend", ["torch", "torch-cascade"])
def test_torch_backends_read_what_the_cache_holds(backend):
    """The torch backends attend to a fresh prefill's own K and V as the cache holds them, as later steps read."""
    rng = np.random.default_rng(5)
    layout = tb.random_layout(rng, *tb.LAYOUTS["several groups"])
    q, k, v, k_cache, v_cache = tb.fused_inputs(layout, 4, 2, torch.float32)
    k_cache, v_cache = (fp8.quantize(c, torch.float8_e4m3fn) for c in (k_cache, v_cache))
    out, _, kc, vc = tb.run_backend(backend, tb.config(4, 2), layout, q, k, v, k_cache, v_cache)
    expected = tb.reference(q, *(fp8.dequantize(c, torch.float32) for c in (kc, vc)), layout, 2)
    assert (out.double() - expected).abs().max().item() < 1e-5


def fp8_attention(dtype: torch.dtype):
    """A transformers attention function: sdpa (the model's eager attention where scores are capped) over K and V
    rounded as an fp8 cache of `dtype` stores them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = (fp8.dequantize(fp8.quantize(x, dtype), x.dtype) for x in (key, value))
        capped = kwargs.get("softcap") is not None
        forward = sys.modules[type(module).__module__].eager_attention_forward if capped else sdpa_attention_forward
        return forward(module, query, key, value, attention_mask, **kwargs)

    return attention


@pytest.fixture(scope="module")
def fp8_references(hf_folders):
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    cache = {}

    def get(kind, fmt):
        if (kind, fmt) not in cache:
            AttentionInterface.register(f"flock_{fmt}", fp8_attention(FORMATS[fmt]))
            AttentionMaskInterface.register(f"flock_{fmt}", eager_mask)  # additive masks, which both take
            model = AutoModelForCausalLM.from_pretrained(hf_folders[kind], dtype=torch.float32,
                                                         attn_implementation=f"flock_{fmt}").eval()
            prompts = shared_prefix_prompts(seed=len(kind))
            cache[kind, fmt] = prompts, model_greedy(model, prompts)
        return cache[kind, fmt]

    return get


def greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("attention, scheduler", [("cpu", "fcfs"), ("cpu", "batchllm"), ("cpu", "feather"),
                                                  ("torch", "fcfs"), ("torch-cascade", "batchllm")])
def test_greedy_matches_transformers_with_the_same_rounding(hf_folders, fp8_references, fmt, attention, scheduler):
    """Float32 Qwen2 (biased K) with an fp8 cache gives the tokens of transformers whose attention reads K and V
    rounded as the cache stores them, under each scheduler, in 3-token chunks and under preemption."""
    if attention == "cpu" and cpu.kernel_unavailable() is not None:
        pytest.skip(cpu.kernel_unavailable())
    prompts, expected = fp8_references("qwen2", fmt)
    for config in ({}, {"max_num_batched_tokens": 3}, {"num_kv_blocks": 16}):
        llm = LLM(str(hf_folders["qwen2"]), dtype="float32", kv_cache_dtype=fmt, attention=attention, block_size=4,
                  scheduler=scheduler, **config)
        assert llm.engine.runner.kv_dtype == FORMATS[fmt]
        assert greedy(llm, prompts) == expected, config
        assert (llm.stats()["preemptions"] > 0) == ("num_kv_blocks" in config) or scheduler == "batchllm"
        assert_no_leak(llm)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "mistral"])
def test_other_models_match_on_the_kernel(hf_folders, fp8_references, kind):
    """GQA Llama, Gemma 2 (capped scores, a window every other layer), Mistral's sliding window."""
    if cpu.kernel_unavailable() is not None:
        pytest.skip(cpu.kernel_unavailable())
    prompts, expected = fp8_references(kind, "fp8")
    llm = LLM(str(hf_folders[kind]), dtype="float32", kv_cache_dtype="fp8", block_size=4, max_num_batched_tokens=16)
    assert isinstance(llm.engine.runner.backend.for_window(None), CpuCascadeBackend)
    assert greedy(llm, prompts) == expected


def test_an_fp8_cache_is_not_the_model_dtype(hf_folders):
    """Without the rounding, some tokens differ: the comparison above can fail."""
    prompts = shared_prefix_prompts(seed=4)
    plain = greedy(LLM(str(hf_folders["qwen2"]), dtype="float32"), prompts)
    rounded = greedy(LLM(str(hf_folders["qwen2"]), dtype="float32", kv_cache_dtype="fp8_e5m2"), prompts)
    assert plain != rounded


def test_the_same_memory_holds_nearly_twice_the_blocks(hf_folders):
    budget = 1 << 22
    plain = LLM(str(hf_folders["llama"]), dtype="bfloat16", kv_cache_memory_bytes=budget).engine.runner
    small = LLM(str(hf_folders["llama"]), dtype="bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype="fp8").engine.runner
    d = plain.model.config.head_dim
    assert small.num_blocks == budget // (plain.kv_bytes_per_block * (d + 4) // (2 * d))
    layer = small.model.attention_layers()[0]
    assert layer.k_cache.dtype == torch.float8_e4m3fn and layer.k_cache.shape[-1] == d + 4
    assert layer.k_cache.numel() * 2 <= budget


def test_the_flag_and_a_bad_value(capsys):
    """`--kv-cache-dtype` (vLLM's flag) on `flock run` and `flock serve`; a bad value names the choices."""
    import argparse

    from flock.engine.args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser, "fcfs")
    assert engine_kwargs(parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"]))["kv_cache_dtype"] == "fp8_e5m2"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        LLM("flock/tiny", kv_cache_dtype="int4")
    LLM("flock/tiny", kv_cache_dtype="fp8", calculate_kv_scales=True)  # vLLM's keyword: every row has its own

