"""Hugging Face folders of GPTQ, AWQ and compressed-tensors weights (flock.model.hf_quant): the blocks hold the
checkpoint's values exactly, dequantized they give transformers' tokens on those values, on the int8 kernels
they stay close and no scheduler changes them, and what no block holds runs in floats."""

import json
import shutil

import numpy as np
import pytest
import torch

from bench.harness import int_checkpoints
from flock import LLM, SamplingParams
from flock.model import hf_quant, program, quant
from flock.model.linear import Linear
from flock.model.llama import SparseMoE
from flock.model.loader import hf_tensor_slots, layer_parts
from tests.engine.test_parity import flock_greedy, hf_greedy, shared_prefix_prompts

FORMATS = [kind for kind, fmt in int_checkpoints.FORMATS.items() if not fmt.fp8]  # integers: kept as blocks
TYPES = {"gptq": "Q4_0", "gptq-asym": "Q5_0", "gptq-8bit": "Q8_0", "gptq-act-order": "Q4_0", "awq": "Q5_0",
         "ct-w4a16": "Q4_0", "ct-w4a16-asym": "Q5_0", "ct-w4a16-act-order": "Q4_0", "ct-w8a8": "Q8_0"}


@pytest.fixture(scope="module")
def checkpoints(hf_folders, tmp_path_factory):
    """(kind, base model) -> (quantized folder, reference folder of the values it holds)."""
    root, made = tmp_path_factory.mktemp("hf_quant"), {}

    def get(kind: str, base: str = "llama", group_size: int = 32):
        key = (kind, base, group_size)
        if key not in made:
            folder = root / f"{base}-{kind}-{group_size}"
            held = int_checkpoints.write(hf_folders[base], folder, kind, group_size)
            made[key] = folder, int_checkpoints.write_reference(hf_folders[base], root / f"{folder.name}-ref", held)
        return made[key]

    return get


def quantized(llm: LLM) -> dict[str, Linear]:
    return {n: m for n, m in llm.engine.runner.model.named_modules() if isinstance(m, Linear) and m.qweight is not None}


def prompt_logprobs(folder, **config) -> np.ndarray:
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(seed=5) if len(p) > 4]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 22, **config)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return np.array([lp.logprob for o in outs for lp in o.prompt_logprobs[1:]])


@pytest.mark.parametrize("kind", FORMATS)
def test_the_blocks_hold_the_checkpoints_values_exactly(checkpoints, kind):
    folder, reference = checkpoints(kind)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 22)
    model = llm.engine.runner.model
    assert model.quantized_types() == {TYPES[kind]: 8}  # every projection; the embedding and head in floats
    from safetensors.torch import load_file

    held, slots = load_file(str(reference / "model.safetensors")), hf_tensor_slots(model)
    layers = quantized(llm)
    for layer, parts in layer_parts(model, slots).items():
        if layer in layers:
            assert torch.equal(quant.dequantize(layers[layer].qweight), torch.cat([held[p] for p in parts])), layer
    act_order = "act-order" in kind
    assert all((m.qweight.order is not None) == act_order for m in layers.values())
    assert (program.unavailable(model) == "a projection gathers its inputs in act-order") == act_order


@pytest.mark.parametrize("kind", ["gptq", "gptq-act-order", "awq", "ct-w4a16-asym", "ct-w8a8"])
def test_dequantized_they_give_transformers_tokens(checkpoints, kind):
    """quantization="none": the checkpoint's values in float64 give transformers' greedy tokens on the same values
    (a wrong bit order, zero offset or group would give others)."""
    folder, reference = checkpoints(kind, "qwen2")  # qkv bias, tied embeddings
    prompts = shared_prefix_prompts(seed=3)
    got, llm = flock_greedy(folder, prompts, quantization="none")
    assert not quantized(llm) and got == hf_greedy(reference, prompts)


@pytest.mark.parametrize("kind", ["fp8-block", "ct-fp8"])
def test_fp8_weights_are_dequantized_to_their_values(checkpoints, kind):
    """fp8 weights (blocks of 32 x 32 with float32 scales; rows with bf16 ones) run in floats: transformers'
    tokens on the values they hold, in float64."""
    folder, reference = checkpoints(kind, "qwen2")
    prompts = shared_prefix_prompts(seed=8)
    got, llm = flock_greedy(folder, prompts)
    assert not quantized(llm) and got == hf_greedy(reference, prompts)
    assert quantized(LLM(str(folder), quantization="q8_0", dtype="float32", kv_cache_memory_bytes=1 << 22))


@pytest.mark.parametrize("kind", ["gptq-asym", "gptq-act-order", "awq", "ct-w8a8"])
def test_on_the_int8_kernels_they_stay_close(checkpoints, kind):
    """int8 activations cost a little precision, never more (as test_quant_models checks GGUF's)."""
    folder, _ = checkpoints(kind)
    got, want = prompt_logprobs(folder), prompt_logprobs(folder, quantization="none")
    diff, size = np.abs(got - want), np.abs(want)
    assert (diff <= 0.02 * size + 0.01).all() and diff.max() > 0 and diff.mean() < 0.005 * size.mean()


@pytest.mark.parametrize("config", [dict(scheduler="batchllm"), dict(scheduler="feather"),
                                    dict(max_num_batched_tokens=7)])
@pytest.mark.parametrize("kind", ["gptq", "gptq-act-order"])
def test_scheduling_never_changes_their_results(checkpoints, kind, config):
    folder, _ = checkpoints(kind)
    prompts = shared_prefix_prompts(seed=6)
    expected, _ = flock_greedy(folder, prompts, dtype="float32")
    got, llm = flock_greedy(folder, prompts, dtype="float32", **config)
    assert got == expected and quantized(llm)


def test_a_mixtures_experts_run_in_one_call(checkpoints):
    folder, _ = checkpoints("awq", "qwen3_moe")
    # "awq", not "auto": on AMX CPUs "auto" dequantizes a model this small to bf16 (quant.blocks_lose)
    llm = LLM(str(folder), dtype="bfloat16", quantization="awq", kv_cache_memory_bytes=1 << 22)
    mixtures = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert mixtures and all(m.grouped is not None and m.grouped.kind == "quantized" for m in mixtures)
    assert not any(name.endswith(".gate") for name in quantized(llm))  # the routers stay in floats


def test_groups_no_block_holds_run_in_floats(checkpoints):
    folder, reference = checkpoints("gptq-asym", group_size=16)  # groups of 16: not a block of 32
    prompts = shared_prefix_prompts(seed=4)
    got, llm = flock_greedy(folder, prompts)
    assert not quantized(llm) and got == hf_greedy(reference, prompts)
    groups = hf_quant.Groups(q=torch.full((2, 32), 100, dtype=torch.uint8), zeros=torch.zeros(2, 1, dtype=torch.int16),
                             scales=torch.tensor([[1.0], [1e-9]]), group=torch.zeros(32, dtype=torch.int64), bits=8)
    assert groups.blocks(None) is None  # 1e-9 is no float16 value
    groups.scales[1] = 0.5
    assert quant.TYPE_NAMES[groups.blocks(None).qtype] == "Q8_0"  # 100: more than Q5_0's 5 bits
    groups.q[:] = 10
    assert quant.TYPE_NAMES[groups.blocks(None).qtype] == "Q5_0"  # 8-bit values that 5 bits hold
    groups.zeros[0], groups.q[0] = 255, 0  # 8-bit differences outside int8
    assert groups.blocks(None) is None
    assert torch.equal(groups.dequantize()[0], torch.full((32,), -255.0))


def test_a_vision_language_checkpoint_keeps_its_decoder_quantized(llava_folder, tmp_path):
    """LLaVA as AWQ (its vision tower in floats, as AutoAWQ leaves it): the decoder's projections in blocks, and
    dequantized the same tokens as the float folder of its values, images and all."""
    from tests.multimodal.models import picture

    held = int_checkpoints.write(llava_folder, tmp_path / "awq", "awq")
    reference = int_checkpoints.write_reference(llava_folder, tmp_path / "reference", held)
    prompt = {"prompt": "Compare <image> with <image> please:",
              "multi_modal_data": {"image": [picture(0), picture(5, (60, 30))]}}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens(folder, **config):
        llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 22, **config)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids, llm

    got, llm = tokens(tmp_path / "awq", quantization="none")
    assert got == tokens(reference)[0] and not quantized(llm)
    _, llm = tokens(tmp_path / "awq")
    assert llm.engine.runner.model.quantized_types() == {"Q5_0": 8}


def test_save_model_writes_the_values_as_floats(checkpoints, tmp_path):
    from safetensors.torch import load_file

    from flock.model import save_model

    folder, reference = checkpoints("awq")
    saved = save_model(str(folder), tmp_path / "saved", dtype="float32")
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    got, want = (load_file(str(f / "model.safetensors")) for f in (saved, reference))
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)


def test_bad_checkpoints_and_settings(checkpoints, hf_folders, tmp_path):
    folder, _ = checkpoints("gptq")
    with pytest.raises(ValueError, match="quantization='awq', but .* holds gptq weights"):
        LLM(str(folder), quantization="awq")
    with pytest.raises(ValueError, match="quantization='gptq', but .* holds no quantized weights"):
        LLM(str(hf_folders["llama"]), quantization="gptq")
    assert quantized(LLM(str(folder), quantization="gptq", dtype="float32", kv_cache_memory_bytes=1 << 22))
    for change, message in [({"bits": 3}, "3-bit gptq weights are not supported"),
                            ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv' is not supported"),
                            ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not supported")]:
        bad = tmp_path / "bad"
        shutil.copytree(folder, bad, dirs_exist_ok=True)
        config = json.loads((bad / "config.json").read_text())
        config["quantization_config"] |= change
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            LLM(str(bad))
    from safetensors.torch import load_file, save_file

    tensors, down = load_file(str(folder / "model.safetensors")), "model.layers.1.mlp.down_proj"

    def variant(name: str, changed: dict):
        shutil.copytree(folder, tmp_path / name)
        save_file(changed, str(tmp_path / name / "model.safetensors"))
        return str(tmp_path / name)

    # AutoGPTQ's zero biases of projections that have none are left out; others are not
    assert quantized(LLM(variant("zero", tensors | {f"{down}.bias": torch.zeros(64)}), dtype="float32",
                         kv_cache_memory_bytes=1 << 22))
    with pytest.raises(ValueError, match=f"unexpected tensor '{down}.bias'"):
        LLM(variant("bias", tensors | {f"{down}.bias": torch.full((64,), 0.5)}))
    with pytest.raises(ValueError, match=f"{down}.weight: gptq tensor 'qzeros' is missing"):
        LLM(variant("missing", {n: t for n, t in tensors.items() if n != f"{down}.qzeros"}))


def test_checkpoint_layouts_vllm_loads(checkpoints, tmp_path):
    """What vLLM reads too: AutoGPTQ's quantize_config.json beside a config.json without quantization_config, KV
    cache scales of "-FP8-KV" checkpoints and static activation scales (unused here); a group_size the scales do
    not match and GPTQModel's per-module bit widths are refused by name, never read wrong."""
    from safetensors.torch import load_file, save_file

    folder, _ = checkpoints("gptq")
    moved = shutil.copytree(folder, tmp_path / "moved")
    config = json.loads((moved / "config.json").read_text())
    (moved / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (moved / "config.json").write_text(json.dumps(config))
    want = quantized(LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 22))
    got = quantized(LLM(str(moved), quantization="gptq", dtype="float32", kv_cache_memory_bytes=1 << 22))
    assert got.keys() == want.keys() and all(torch.equal(quant.dequantize(got[n].qweight),
                                                          quant.dequantize(want[n].qweight)) for n in got)
    scales = shutil.copytree(folder, tmp_path / "scales")
    tensors = load_file(str(folder / "model.safetensors"))
    extra = {f"model.layers.{i}.self_attn.{s}": torch.tensor(0.5) for i in range(2) for s in ("k_scale", "v_scale")}
    save_file(tensors | extra, str(scales / "model.safetensors"))
    assert quantized(LLM(str(scales), dtype="float32", kv_cache_memory_bytes=1 << 22)).keys() == want.keys()
    ct, _ = checkpoints("ct-w8a8")
    static = shutil.copytree(ct, tmp_path / "static")
    ct_tensors = load_file(str(ct / "model.safetensors"))
    inputs = {n.replace("weight_scale", "input_scale"): torch.tensor([0.1]) for n in ct_tensors
              if n.endswith("weight_scale")}
    save_file(ct_tensors | inputs, str(static / "model.safetensors"))
    assert quantized(LLM(str(static), dtype="float32", kv_cache_memory_bytes=1 << 22))
    for change, message in [({"group_size": 128}, "do not make a .* weight of groups of 128"),
                            ({"dynamic": {r"+:.*\.1\..*": {"bits": 8}}}, "dynamic overrides of bits")]:
        bad = shutil.copytree(folder, tmp_path / f"bad{len(message)}")
        config = json.loads((bad / "config.json").read_text())
        config["quantization_config"] |= change
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            LLM(str(bad))
