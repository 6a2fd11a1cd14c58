"""LoRA adapters as PEFT saves them (`adapter_config.json` and `adapter_model.safetensors` or `.bin`), or as
llama.cpp's convert_lora_to_gguf.py writes them (one GGUF file: `<tensor>.lora_a` / `.lora_b`, adapter.lora.alpha).

Each target projection's update is B A scaled by lora_alpha / r (PEFT's `use_rslora`: / sqrt(r); its
`rank_pattern` and `alpha_pattern` per module); the scale is folded into B. Adapters of the attention and dense
MLP projections load; those that change other weights (embeddings, the LM head, `modules_to_save`, experts,
PiSSA-style inits), DoRA, aLoRA and LoRA biases are refused by name, as vLLM refuses them.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

PEFT_PREFIX = "base_model.model."
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")  # inits that leave a plain LoRA adapter, as vLLM


@dataclass
class Update:
    """One projection's low-rank update: y += (x A^T) B^T, B already scaled."""

    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features of the part, r]


@dataclass
class Adapter:
    name: str
    path: Path
    rank: int  # the largest of its modules'
    updates: dict[str, Update]  # Hugging Face module name ("model.layers.0.self_attn.q_proj") -> its update


def load_adapter(name: str, path: str | Path) -> Adapter:
    """The adapter saved in the folder `path` (ValueError naming what is wrong)."""
    folder = Path(path)
    config = _config(folder)
    tensors = _tensors(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key.removeprefix(PEFT_PREFIX))
        if match is None:
            raise ValueError(f"{folder}: tensor {key!r} is not a LoRA A or B weight (LoRA biases, embedding "
                             "updates and modules_to_save are not supported)")
        pairs.setdefault(match[1], {})[match[2]] = tensor.float()
    return _adapter(name, folder, pairs, lambda module, rank: _scale(config, module, rank))


def load_gguf_adapter(name: str, path: str | Path, model_type: str, heads: dict[str, int],
                      hf_modules: list[str]) -> Adapter:
    """A llama.cpp LoRA adapter (a GGUF file) for a model of `model_type` and `heads` (num_attention_heads,
    num_key_value_heads: llama.cpp's q/k row order is undone), whose projections are `hf_modules`; llama.cpp's
    scale: alpha / r (1 without alpha)."""
    from gguf import GGUFReader

    from flock.model.gguf import dequantize, gguf_to_hf_names, hf_rows, llama_cpp_architecture

    try:
        reader = GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith(("general.", "adapter."))}
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise ValueError(f"{path} is not a LoRA adapter (general.type {fields.get('general.type')!r}, adapter.type "
                         f"{fields.get('adapter.type')!r}; llama.cpp's convert_lora_to_gguf.py writes adapter, lora)")
    arch = llama_cpp_architecture(model_type)
    if fields.get("general.architecture") != arch:
        raise ValueError(f"{path} is an adapter of a {fields.get('general.architecture')} model, not of this {arch}")
    layers = 1 + max(int(m.split(".")[2]) for m in hf_modules)
    names = gguf_to_hf_names(arch, layers, [f"{m}.weight" for m in hf_modules])
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        base, _, part = tensor.name.rpartition(".lora_")
        if part not in ("a", "b") or base not in names:
            raise ValueError(f"{path}: tensor {tensor.name!r} is not a LoRA A or B of this model's projections")
        values = dequantize(tensor).astype(np.float32)
        values = hf_rows(values, base, arch, heads) if part == "b" else values
        pairs.setdefault(names[base].removesuffix(".weight"), {})[part.upper()] = torch.from_numpy(values)
    alpha = float(fields.get("adapter.lora.alpha") or 0)
    return _adapter(name, Path(path), pairs, lambda module, rank: alpha / rank if alpha else 1.0)


def _adapter(name: str, path: Path, pairs: dict[str, dict[str, torch.Tensor]], scale) -> Adapter:
    """The adapter of each module's A and B (float32), B scaled by scale(module, rank)."""
    updates = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{path}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, not "
                             "[r, in] and [out, r]")
        updates[module] = Update(a, b * scale(module, a.shape[0]))
    if not updates:
        raise ValueError(f"{path}: the adapter holds no LoRA weights")
    return Adapter(name, path, max(u.a.shape[0] for u in updates.values()), updates)


def _config(folder: Path) -> dict:
    file = folder / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"{folder}: no adapter_config.json (a LoRA adapter is a folder PEFT saved)")
    config = json.loads(file.read_text())
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{folder}: peft_type {peft_type!r} is not supported, only LORA")
    for key, off in (("use_dora", False), ("bias", "none"), ("modules_to_save", None), ("lora_bias", False),
                     ("fan_in_fan_out", False), ("alora_invocation_tokens", None), ("layer_replication", None),
                     ("use_bdlora", None), ("use_qalora", False)):
        if config.get(key) not in (off, None, []):
            raise ValueError(f"{folder}: {key}={config[key]!r} is not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in PLAIN_INITS:
        raise ValueError(f"{folder}: init_lora_weights={init!r} is not supported: PiSSA, OLoRA, CorDA and LoftQ "
                         "adapters change the base model's weights when PEFT loads them (convert it to a plain LoRA "
                         "adapter with PEFT's path_initial_model_for_weight_conversion)")
    return config


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "adapter_model.safetensors").is_file():
        return load_file(str(folder / "adapter_model.safetensors"))
    if (folder / "adapter_model.bin").is_file():
        return torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{folder}: no adapter_model.safetensors or adapter_model.bin")


def _scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of a module's update: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):  # PEFT's rule: the key (a regex) ends the name
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
