"""LoRA adapters saved by PEFT over the random-weight test models, and PEFT's own greedy tokens as the reference."""

import json
from pathlib import Path

import numpy as np
import torch

from tests.engine.test_parity import model_greedy

ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALL_FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's module names


def make_adapter(base: Path, out: Path, seed: int, targets: list[str], r: int = 8, alpha: int = 16, **config) -> Path:
    """An adapter whose A and B are both random (PEFT's init_lora_weights=False), so it changes the outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **config)
    get_peft_model(model, lora).save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_new: int,
                dtype=torch.float64) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model_greedy(model.to(dtype).eval(), prompts, max_new)


def gguf_adapter(peft_folder: Path, out: Path, arch: str, heads: int, kv_heads: int) -> Path:
    """The PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: llama.cpp's tensor names + .lora_a /
    .lora_b, B of q and k in llama.cpp's row order (Llama's), float32, adapter.lora.alpha."""
    import gguf
    from safetensors.torch import load_file

    from tests.model.gguf_files import llama_cpp_permute

    config = json.loads((peft_folder / "adapter_config.json").read_text())
    table = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), 64)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for key, tensor in sorted(load_file(str(peft_folder / "adapter_model.safetensors")).items()):
        module, part = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        name = f"{table.get_name(module)}.weight.lora_{part[0].lower()}"
        values = tensor.float().numpy()
        if part.startswith("B") and arch == "llama" and module.endswith(("q_proj", "k_proj")):
            values = llama_cpp_permute(values, heads if module.endswith("q_proj") else kv_heads)
        writer.add_tensor(name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
