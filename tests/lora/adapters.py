"""LoRA adapters saved by PEFT over the random-weight test models, and PEFT's own greedy tokens as the reference."""

from pathlib import Path

import torch

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
    model = model.to(dtype).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out
