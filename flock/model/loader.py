"""Weights in and out of Hugging Face folders: safetensors (single or sharded) and random ("dummy")."""

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flock.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from flock.model.hf_quant import Scheme

# tensors no model needs: RoPE's table; a quantized checkpoint's KV cache and attention scales (llm-compressor's,
# AutoFP8's "-FP8-KV"; vLLM uses them for an fp8 KV cache, Flock's fp8 cache scales each token's row itself)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale")
LOW_BITS = ("I8", "F8_E4M3")  # weights a quantization scheme reads (int8, fp8), not float ones
# a multimodal checkpoint's text decoder, as its layouts name it (older files, transformers 5's, Idefics3's), and the
# parts of it Flock does not run
TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.":
                 "lm_head.", "model.text_model.": "model."}
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                   "model.vision_model.", "model.connector.", "visual.", "model.visual.")
FUSED_CHECKPOINTS = ("phi3",)  # model types whose checkpoints hold qkv_proj and gate_up_proj fused, as Flock does
# checkpoint names of a model type that are not Flock's (Mixtral's experts): Flock's -> the checkpoint's
HF_RENAMES = {"mixtral": ((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."),
                          (".down_proj.", ".w2."))}


@dataclass
class TensorSlot:
    """Where one Hugging Face tensor lives in our model: a parameter, or a row range of a fused one."""

    param: torch.nn.Parameter
    offset: int
    rows: int


def hf_tensor_slots(model: LlamaForCausalLM) -> dict[str, TensorSlot]:
    """Map every Hugging Face tensor name of the architecture to its place in `model`."""
    slots = {}
    renames = HF_RENAMES.get(model.config.model_type, ())
    for name, param in model.named_parameters(remove_duplicate=True):
        hf_name = name if name.startswith(("lm_head.", "score.")) else f"model.{name}"
        module_name, _, kind = name.rpartition(".")
        fused = module_name.rsplit(".", 1)[-1]
        # a weight kept quantized has no float rows: its layer's outputs count
        rows = getattr(model.get_submodule(module_name), "out_features", None) if kind == "weight" else None
        rows = rows or param.shape[0]
        if fused not in model.packed_modules or model.config.model_type in FUSED_CHECKPOINTS:
            slots[_renamed(hf_name, renames)] = TensorSlot(param, 0, rows)
            continue
        offset = 0
        for part, rows in zip(model.packed_modules[fused], _fused_rows(model, rows, fused)):
            slots[_renamed(hf_name.replace(f".{fused}.", f".{part}."), renames)] = TensorSlot(param, offset, rows)
            offset += rows
    return slots


def layer_parts(model: LlamaForCausalLM, slots: dict[str, TensorSlot]) -> dict[str, list[str]]:
    """Each projection (and embedding) -> the Hugging Face names of its weight's parts, in row order (q, k, v)."""
    from flock.model.linear import Embedding, Linear

    modules = dict(model.named_modules())
    layer_of = {id(p): name.removesuffix(".weight") for name, p in model.named_parameters()
                if name.endswith(".weight") and isinstance(modules[name.removesuffix(".weight")], (Linear, Embedding))}
    layers: dict[str, list[tuple[int, str]]] = {}
    for hf_name, slot in slots.items():
        if id(slot.param) in layer_of:
            layers.setdefault(layer_of[id(slot.param)], []).append((slot.offset, hf_name))
    return {layer: [name for _, name in sorted(parts)] for layer, parts in layers.items()}


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for ours, theirs in renames:
        name = name.replace(ours, theirs)
    return name


def _fused_rows(model: LlamaForCausalLM, rows: int, fused: str) -> list[int]:
    c = model.config
    if fused == "qkv_proj":
        kv = c.num_key_value_heads * c.head_dim
        return [c.num_attention_heads * c.head_dim, kv, kv]
    return [rows // 2] * 2  # gate and up (an expert's, a shared expert's, or the MLP's)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))


def load_safetensors(model: LlamaForCausalLM, folder: Path, scheme: "Scheme | None" = None,
                     in_blocks: Collection[str] = ()) -> None:
    """Load a folder's tensors into `model`; with a quantization `scheme` (flock.model.hf_quant) the packed
    projections of `in_blocks` stay quantized, the others are dequantized."""
    from flock.model import hf_quant

    files = safetensors_files(folder)
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (use load_format='dummy' for random weights)")
    slots = hf_tensor_slots(model)
    loaded, packed, packed_names = set(), {}, scheme.names() if scheme else ()
    for file in files:
        if not file.exists():
            raise FileNotFoundError(f"{folder}: shard {file.name} named in the index is missing")
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                key = text_decoder_name(name) if model.config.multimodal else name
                if key is None or key.endswith(IGNORED_SUFFIXES) or (model.config.tie_word_embeddings
                                                                     and key == "lm_head.weight"):
                    continue
                prefix, _, suffix = key.rpartition(".")
                if suffix in packed_names and (suffix != "weight" or f.get_slice(name).get_dtype() in LOW_BITS):
                    packed.setdefault(_slot_name(f"{prefix}.weight", slots, model), {})[suffix] = f.get_tensor(name)
                    continue
                key = _slot_name(key, slots, model)
                slot = slots.get(key)
                if slot is None and scheme and suffix == "bias" and not f.get_tensor(name).any():
                    continue  # AutoGPTQ writes zero biases for projections that have none
                if slot is None:
                    raise ValueError(f"{file.name}: unexpected tensor {name!r} for {model.config.model_type}")
                copy_into(slot, f.get_tensor(name), name, file.name)
                loaded.add(key)
    if scheme:
        loaded |= hf_quant.load_packed(model, slots, packed, scheme, in_blocks, folder.name)
    missing_tensors(slots, loaded, folder)


def slot_name(name: str, slots: dict[str, TensorSlot], model: LlamaForCausalLM) -> str | None:
    """A checkpoint tensor's name as `hf_tensor_slots` keys it (None: not the text decoder's)."""
    key = text_decoder_name(name) if model.config.multimodal else name
    return None if key is None else _slot_name(key, slots, model)


def _slot_name(key: str, slots: dict[str, TensorSlot], model: LlamaForCausalLM) -> str:
    return f"model.{key}" if key not in slots and model.config.base_model else key  # Qwen3Model's


def text_decoder_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under the name a text-only model gives it (None: not the decoder's)."""
    if name.startswith(VISION_PREFIXES):
        return None
    return next((short + name[len(long):] for long, short in TEXT_PREFIXES.items() if name.startswith(long)), name)


def missing_tensors(slots: dict[str, TensorSlot], loaded: set[str], where) -> None:
    missing = sorted(set(slots) - loaded)
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def copy_into(slot: TensorSlot, tensor: torch.Tensor, name: str, file: str) -> None:
    target = slot.param.data[slot.offset : slot.offset + slot.rows]
    if tensor.shape != target.shape:
        raise ValueError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)


def init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights, reproducible from the seed whatever the dtype (drawn in float32, then cast)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            values = torch.ones(param.shape)
        else:
            values = torch.randn(param.shape, generator=gen) * 0.02
        param.data.copy_(values)


def save_safetensors(model: LlamaForCausalLM, folder: Path, dtype: torch.dtype | None = None) -> None:
    """Write the weights under Hugging Face names (fused tensors split back), loadable by any engine."""
    tensors = {}
    for name, slot in hf_tensor_slots(model).items():
        t = slot.param.data[slot.offset : slot.offset + slot.rows]
        tensors[name] = t.to(dtype or t.dtype).contiguous().clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
