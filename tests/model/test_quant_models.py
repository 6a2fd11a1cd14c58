"""GGUF models on their quantized blocks (EngineConfig.quantization): which layers stay quantized and in what
memory, agreement with the same file dequantized, results no scheduler or chunk size changes, and weights
quantized at load."""

import gguf
import numpy as np
import pytest
import torch

from flock import LLM, SamplingParams
from flock.model import quant
from flock.model.linear import Embedding, Linear
from flock.model.llama import SparseMoE
from flock.model.quant import KERNEL_TYPES, QuantWeight
from tests.engine.test_parity import flock_greedy, shared_prefix_prompts
from tests.model import gguf_files
from tests.model.gguf_files import Q, write_gguf

K_MIX = {"blk.0.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K, "blk.1.ffn_gate.weight": Q.Q5_K,
         "blk.1.ffn_up.weight": Q.Q5_K, "token_embd.weight": Q.Q6_K}  # Q4_K_M's kind of mix, and more
CASES = {"Q8_0": ("llama", Q.Q8_0, None), "Q4_0": ("llama", Q.Q4_0, None), "Q4_1": ("qwen2", Q.Q4_1, None),
         "Q5_0": ("llama", Q.Q5_0, None), "Q5_1": ("llama", Q.Q5_1, None), "K-quants": ("llama256", Q.Q4_K, K_MIX),
         "IQ4_XS": ("llama256", Q.IQ4_XS, None), "Q2_K": ("llama256", Q.Q2_K, None), "Q3_K": ("llama256", Q.Q3_K, None),
         "Gemma 3 Q8_0": ("gemma3", Q.Q8_0, None),  # GeGLU: its gate_up GEMM gives both halves
         "Qwen3-MoE Q8_0": ("qwen3_moe", Q.Q8_0, None),  # each expert a slice of its layer's 3D tensor
         "Qwen2-MoE Q8_0": ("qwen2_moe", Q.Q8_0, None),  # a shared expert beside them
         "Mixtral Q4_0": ("mixtral", Q.Q4_0, None)}  # float32 routing weights


MIXTURES = ("qwen3_moe", "qwen2_moe", "mixtral")


@pytest.fixture(scope="module")
def gguf_models(hf_folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {name: write_gguf(hf_folders[kind], root / f"{name}.gguf", qtype, types)
            for name, (kind, qtype, types) in CASES.items()}


def layers(llm: LLM) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in llm.engine.runner.model.named_modules() if isinstance(m, (Linear, Embedding))}


def file_bytes(path) -> dict[str, int]:
    from gguf import GGUFReader

    return {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}


def in_file_layout(weight: QuantWeight) -> int:
    """The bytes of the weight's blocks in the file's row layout."""
    return sum(p.rows * p.k // p.act_block * KERNEL_TYPES[p.name][2] for p in weight.parts)


@pytest.mark.parametrize("case", list(CASES))
def test_every_projection_stays_in_the_files_blocks(gguf_models, case):
    llm = LLM(str(gguf_models[case]), dtype="float32", kv_cache_memory_bytes=1 << 20)
    # routers stay in floats in the file, as llama-quantize keeps them
    found = {name: m for name, m in layers(llm).items() if not name.endswith((".mlp.gate", ".shared_expert_gate"))}
    assert all(m.qweight is not None and m.weight.numel() == 0 for m in found.values())
    held = {id(m.qweight): m.qweight for m in found.values()}  # a tied lm_head holds the embedding's
    matrices = {name: n for name, n in file_bytes(gguf_models[case]).items()
                if not name.endswith(("norm.weight", "bias", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))}
    assert sum(map(in_file_layout, held.values())) == sum(matrices.values())
    interleaved = [p for w in held.values() for p in w.parts if p.interleaved]
    assert bool(interleaved) == (quant.isa() != "baseline")
    # the interleaved layouts' unpacked scales: at most 4 bytes more a super-block (Q3_K's 114 for 110)
    assert sum(w.nbytes for w in held.values()) <= 1.037 * sum(matrices.values())
    types = llm.engine.runner.model.quantized_types()
    if case == "K-quants":
        assert types == {"Q4_K+Q6_K": 1, "Q4_K": 6, "Q5_K": 1, "Q6_K": 1}  # qkv of layer 0 mixes two
    else:
        assert set(types) == {CASES[case][1].name}
    assert "quantized" in llm.engine.runner.paths
    mixtures = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert all(m.grouped is not None and m.grouped.kind == "quantized" for m in mixtures) and bool(mixtures) == (CASES[case][0] in MIXTURES)


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_logprobs_close_to_the_dequantized_file(gguf_models, case):
    """int8 activations cost a little precision, never more: every prompt token's logprob within 2% of the
    same weights' dequantized one (3% where the activations' blocks are 256 values, as llama.cpp's K-quants and
    IQ4_XS meet them: their step is about 1.5x a 32-block's), 0.5% on average (a wrong block layout or row order
    is off by whole nats)."""
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(seed=5) if len(p) > 4]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    got = {}
    for quantization in ("auto", "none"):
        llm = LLM(str(gguf_models[case]), dtype="float32", quantization=quantization, kv_cache_memory_bytes=1 << 22)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[quantization] = np.array([lp.logprob for o in outs for lp in o.prompt_logprobs[1:]])
    diff, size = np.abs(got["auto"] - got["none"]), np.abs(got["none"])
    bound = 0.03 if KERNEL_TYPES[CASES[case][1].name][1] == 256 else 0.02
    assert (diff <= bound * size + 0.01).all() and diff.max() > 0
    assert diff.mean() < 0.005 * size.mean()


@pytest.mark.parametrize("kind, qtype", [("llama", Q.IQ4_NL), ("qwen3_moe", Q.IQ4_NL),
                                         *(("llama256", qtype) for qtype in gguf_files.LATTICE)],
                         ids=["IQ4_NL", "Qwen3-MoE IQ4_NL", *(qtype.name for qtype in gguf_files.LATTICE)])
def test_transcoded_types_run_as_the_blocks_of_the_same_values(hf_folders, tmp_path, monkeypatch, kind, qtype):
    """IQ4_NL projections (a mixture's experts too) run as the Q8_0 blocks of their values, and the lattice IQ types'
    as IQ4_XS's or Q3_K's blocks with their own table of values, rewritten at load, in 1.89x (IQ4_NL), 1.39x
    (IQ3_XXS), 1.24x (IQ3_S), 2.06x (IQ2_XXS), 2.72x (IQ1_S), 1.49x (IQ2_XS), 1.34x (IQ2_S) and 1.96x (IQ1_M) the
    file's bytes: every weight the value the gguf package dequantizes from the file."""
    path = write_gguf(hf_folders[kind], tmp_path / "t.gguf", qtype)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 20)
    target = quant.TRANSCODED[qtype.name][3]
    assert set(llm.engine.runner.model.quantized_types()) == {target}
    blocks = {name: m for name, m in layers(llm).items() if not name.endswith(".mlp.gate")}  # routers: floats
    held = {id(m.qweight): m.qweight for m in blocks.values()}
    stored = sum(n for name, n in file_bytes(path).items() if not name.endswith(("norm.weight", "gate_inp.weight")))
    per_block = quant.X8_BYTES[target] if quant.isa() != "baseline" else KERNEL_TYPES[target][2]  # interleaved
    ratio = per_block / quant.TRANSCODED[qtype.name][2]
    assert sum(w.nbytes for w in held.values()) == pytest.approx(ratio * stored, rel=0.02)
    monkeypatch.setattr(quant, "BLOCK_TYPES", {spec[0] for spec in KERNEL_TYPES.values()})  # gguf's dequantizer
    expected = layers(LLM(str(path), dtype="float32", quantization="none", ops="torch", kv_cache_memory_bytes=1 << 20))
    for name, layer in blocks.items():
        assert torch.equal(quant.dequantize(layer.qweight), expected[name].weight), name


@pytest.mark.parametrize("qtype", [Q.IQ3_XXS, Q.IQ2_XXS])
def test_lattice_tensors_of_tiny_d_stay_on_the_blocks(hf_folders, tmp_path, qtype):
    """Blocks whose d / m is no fp16 value (subnormal d's with low bits set, as small weights give IQ2_XXS) keep
    their layer on the kernels, each weight the gguf package's value: d is kept and 1 / m applied in float32."""
    from gguf import GGUFReader

    size = gguf.GGML_QUANT_SIZES[qtype][1]
    path = write_gguf(hf_folders["llama256"], tmp_path / "t.gguf", qtype)
    tiny = next(t for t in GGUFReader(str(path), "r+").tensors if t.name == "blk.1.attn_output.weight")
    tiny.data.reshape(-1, size)[:3, :2] = np.array([1, 9, 1023], np.uint16).view(np.uint8).reshape(3, 2)
    expected = gguf.quants.dequantize(np.array(tiny.data), qtype)
    del tiny
    found = layers(LLM(str(path), dtype="float32", ops="torch", kv_cache_memory_bytes=1 << 20))
    weight = found["layers.1.self_attn.o_proj"].qweight
    assert weight is not None and torch.equal(quant.dequantize(weight), torch.from_numpy(expected))


@pytest.mark.parametrize("config", [dict(scheduler="batchllm"), dict(scheduler="feather"),
                                    dict(max_num_batched_tokens=7), dict(enable_prefix_caching=False)])
def test_scheduling_never_changes_quantized_results(gguf_models, config):
    """Each row's activations are quantized and multiplied alone: a step's other rows never change them."""
    prompts = shared_prefix_prompts(seed=6)
    expected, _ = flock_greedy(gguf_models["K-quants"], prompts, dtype="float32")
    got, llm = flock_greedy(gguf_models["K-quants"], prompts, dtype="float32", **config)
    assert got == expected and llm.engine.runner.model.quantized_types()


@pytest.mark.parametrize("config", [dict(scheduler="feather"), dict(max_num_batched_tokens=7)])
def test_scheduling_never_changes_a_quantized_mixture(gguf_models, config):
    """The experts of a step's tokens run in one call: a token's experts and sums never depend on the others."""
    prompts = shared_prefix_prompts(seed=7)
    expected, _ = flock_greedy(gguf_models["Qwen3-MoE Q8_0"], prompts, dtype="bfloat16", scheduler="batchllm")
    got, _ = flock_greedy(gguf_models["Qwen3-MoE Q8_0"], prompts, dtype="bfloat16", **config)
    assert got == expected


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_float_weights_quantized_at_load(hf_folders, kind):
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(seed=7) if len(p) > 4]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    got = {}
    for quantization in (kind, "none"):
        llm = LLM(str(hf_folders["llama"]), dtype="float32", quantization=quantization)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[quantization] = np.array([lp.logprob for o in outs for lp in o.prompt_logprobs[1:]])
    assert set(layers(llm)) and all(m.qweight is None for m in layers(llm).values())
    # 8-bit weights lose little; 4-bit ones (of these random weights) a few percent
    assert np.abs(got[kind] - got["none"]).mean() < (0.005 if kind == "q8_0" else 0.05) * np.abs(got["none"]).mean()


def test_a_float_mixture_quantized_at_load_runs_its_experts_in_one_call(hf_folders):
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(seed=8) if len(p) > 4]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    got = {}
    for quantization in ("q8_0", "none"):
        llm = LLM(str(hf_folders["qwen3_moe"]), dtype="float32", quantization=quantization)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[quantization] = np.array([lp.logprob for o in outs for lp in o.prompt_logprobs[1:]])
        mixtures = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
        assert all((m.grouped is not None) == (quantization == "q8_0") for m in mixtures) and mixtures
    assert np.abs(got["q8_0"] - got["none"]).mean() < 0.005 * np.abs(got["none"]).mean()


def test_float64_and_bad_settings(gguf_models, hf_folders):
    llm = LLM(str(gguf_models["Q8_0"]), dtype="float64")  # auto: dequantized, the reference
    assert all(m.qweight is None for m in layers(llm).values()) and "quantized" not in llm.engine.runner.paths
    with pytest.raises(ValueError, match="quantization='q8_0': the quantized GEMM takes float32 and bfloat16"):
        LLM(str(hf_folders["llama"]), dtype="float64", quantization="q8_0")
    with pytest.raises(ValueError, match="quantization must be one of auto, gguf, gptq, awq, compressed-tensors, "
                                         "fp8, none, q8_0, q4_0, got 'int3'"):
        LLM(str(hf_folders["llama"]), quantization="int3")


def test_auto_dequantizes_small_bf16_models_where_the_amx_gemm_runs(gguf_models, monkeypatch):
    from flock.model import gemm

    amx = gemm.isa() == "amx"
    auto, kept = (LLM(str(gguf_models["Q8_0"]), dtype="bfloat16", quantization=q, kv_cache_memory_bytes=1 << 22)
                  for q in ("auto", "gguf"))
    assert all(m.qweight is not None for m in layers(kept).values())
    assert all((m.qweight is None) == amx for m in layers(auto).values())
    monkeypatch.setattr(gemm, "isa", lambda: "amx")
    assert "AMX GEMM" in quant.blocks_lose(torch.bfloat16, quant.AMX_DEQUANTIZE_BYTES)
    assert quant.blocks_lose(torch.bfloat16, quant.AMX_DEQUANTIZE_BYTES + 1) is None
    assert quant.blocks_lose(torch.float32, 1) is None
    monkeypatch.setattr(gemm, "isa", lambda: "avx512bf16")
    assert quant.blocks_lose(torch.bfloat16, 1) is None
