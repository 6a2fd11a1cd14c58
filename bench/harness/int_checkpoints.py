"""Quantized Hugging Face checkpoints written from a float folder, in the layouts GPTQ, AutoAWQ and llm-compressor
save (by round to nearest, not their calibrated searches: the layout is what an engine reads), and the float
weights each one holds, for reference folders that transformers loads.

A format's projections ([n, k] weights) are cut into groups of `group_size` inputs per output row, each with a
scale (and a zero point where asymmetric): w = (q - zero) * scale.
"""

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from flock.model.loader import VISION_PREFIXES  # a vision tower stays in floats, as the methods leave it

PROJECTION = re.compile(r"\.((q|k|v|o|qkv|gate|up|down|gate_up)_proj|w[123])\.weight$")
SAME_INPUT = re.compile(r"\.([qkv]_proj|gate_proj|up_proj|w[13])$")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Format:
    method: str  # gptq, awq, compressed-tensors
    bits: int = 4
    symmetric: bool = True
    act_order: bool = False
    packed: bool = True  # compressed-tensors: pack-quantized (else int-quantized)
    fp8: bool = False  # e4m3 weights: by blocks of group_size x group_size (fp8), by row (compressed-tensors)


FORMATS = {
    "gptq": Format("gptq"), "gptq-asym": Format("gptq", symmetric=False), "gptq-8bit": Format("gptq", bits=8),
    "gptq-act-order": Format("gptq", act_order=True), "awq": Format("awq", symmetric=False),
    "ct-w4a16": Format("compressed-tensors"), "ct-w4a16-asym": Format("compressed-tensors", symmetric=False),
    "ct-w4a16-act-order": Format("compressed-tensors", act_order=True),
    "ct-w8a8": Format("compressed-tensors", bits=8, packed=False),
    "fp8-block": Format("fp8", bits=8, fp8=True), "ct-fp8": Format("compressed-tensors", bits=8, fp8=True),
}


def write(src: Path, dst: Path, kind: str, group_size: int = 32, seed: int = 0,
          reference: bool = True) -> dict[str, torch.Tensor]:
    """Write `src` (a float Hugging Face folder) quantized as FORMATS[kind] to `dst`, in one safetensors file;
    return the float32 weight each quantized projection holds (the reference; none unless `reference`)."""
    fmt = FORMATS[kind]
    _copy_folder(src, dst)
    tensors, held = _tensors(src), {}
    gen = np.random.default_rng(seed)
    group = group_size if fmt.method != "compressed-tensors" or fmt.packed else -1  # W8A8: one scale per row
    perms = {}  # act-order: projections of one input share its order, as GPTQ's Hessian gives them
    for name in [n for n in tensors if PROJECTION.search(n) and not n.startswith(VISION_PREFIXES)]:
        w = tensors.pop(name).float()
        prefix = name.removesuffix(".weight")
        n, k = w.shape
        if fmt.fp8:
            values, scales, expanded = _fp8(w, group if fmt.method == "fp8" else None)
            held[name] = values.float() * expanded
            scale_name = "weight_scale_inv" if fmt.method == "fp8" else "weight_scale"
            tensors.update({f"{prefix}.weight": values, f"{prefix}.{scale_name}": scales})
            continue
        size = k if group == -1 else group
        shared = SAME_INPUT.sub(".in_proj", prefix)
        perm = perms.setdefault(shared, torch.from_numpy(gen.permutation(k)) if fmt.act_order else torch.arange(k))
        group_of = torch.empty(k, dtype=torch.int64)
        group_of[perm] = torch.arange(k) // size  # act-order: the groups take the inputs in a shuffled order
        q, zeros, scales = _round(w, group_of, k // size, fmt)
        if reference:
            held[name] = (q.float() - zeros[:, group_of].float()) * scales[:, group_of].float()
        tensors.update({f"{prefix}.{s}": t for s, t in _packed(fmt, q, zeros, scales, group_of).items()})
    tensors = {n: t.contiguous() for n, t in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = _config(fmt, group)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return held


def write_reference(src: Path, dst: Path, held: dict[str, torch.Tensor]) -> Path:
    """`src` with the quantized projections' float values in place of its weights (what transformers loads)."""
    _copy_folder(src, dst)
    tensors = _tensors(src)
    tensors.update({name: w.to(tensors[name].dtype) for name, w in held.items()})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(str(file)).items()}


def _copy_folder(src: Path, dst: Path) -> None:
    """The folder's files but its weights (and their shards' index)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)


def _round(w: torch.Tensor, group_of: torch.Tensor, groups: int, fmt: Format):
    """Round to nearest: q (int64 [n, k], 0 .. 2^bits - 1), zeros (int64 [n, groups]) and scales [n, groups] in
    the checkpoint's dtype (float16; bfloat16 for compressed-tensors, as llm-compressor saves a bf16 model's)."""
    top = (1 << fmt.bits) - 1
    lows = torch.stack([w[:, group_of == g].amin(1) for g in range(groups)], 1)
    highs = torch.stack([w[:, group_of == g].amax(1) for g in range(groups)], 1)
    if fmt.symmetric:
        scales = torch.maximum(lows.abs(), highs) * 2 / top
        zeros = torch.full_like(scales, (top + 1) // 2, dtype=torch.int64)
    else:
        scales = (highs - lows) / top
        first = 1 if fmt.method == "gptq" else 0  # GPTQ's first format stores zero - 1, so zero 0 has no code
        zeros = torch.round(-lows / scales).to(torch.int64).clamp(first, top)
    scales = scales.to(torch.bfloat16 if fmt.method == "compressed-tensors" else torch.float16)
    q = torch.round(w / scales[:, group_of].float()) + zeros[:, group_of]
    return q.clamp(0, top).to(torch.int64), zeros, scales


def _fp8(w: torch.Tensor, block: int | None):
    """e4m3 values, their scales (float32 by block x block, as DeepSeek's and Qwen's fp8 files; bf16 by row, as
    llm-compressor's), and the scales repeated over the weight."""
    n, k = w.shape
    if block:
        amax = w.abs().view(n // block, block, k // block, block).amax((1, 3))
        scales = amax / 448
        expanded = scales.repeat_interleave(block, 0).repeat_interleave(block, 1)
    else:
        scales = (w.abs().amax(1, keepdim=True) / 448).bfloat16()
        expanded = scales.float().expand(n, k)
    return (w / expanded).to(torch.float8_e4m3fn), scales, expanded


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Values (int64, unsigned) as int32 words along `dim`, the first value in the low bits."""
    per = 32 // bits
    v = values if dim == 1 else values.T
    words = (v.reshape(v.shape[0], -1, per) << (torch.arange(per) * bits)).sum(-1)
    words = torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))
    return words if dim == 1 else words.T.contiguous()


def _packed(fmt: Format, q, zeros, scales, group_of) -> dict[str, torch.Tensor]:
    """The tensors of one projection, by suffix, as the format stores them."""
    if fmt.method == "gptq":
        return {"qweight": _pack(q.T, fmt.bits, 0), "qzeros": _pack(zeros.T - 1, fmt.bits, 1),
                "scales": scales.T.contiguous(), "g_idx": group_of.to(torch.int32)}
    if fmt.method == "awq":
        order = [c + i for c in range(0, q.shape[0], 8) for i in AWQ_PACK_ORDER]
        return {"qweight": _pack(q.T[:, order], 4, 1), "qzeros": _pack(zeros.T[:, order], 4, 1),
                "scales": scales.T.contiguous()}
    offset = 1 << (fmt.bits - 1)
    if not fmt.packed:
        return {"weight": (q - offset).to(torch.int8), "weight_scale": scales}
    out = {"weight_packed": _pack(q, fmt.bits, 1), "weight_scale": scales,
           "weight_shape": torch.tensor(q.shape, dtype=torch.int64)}
    if not fmt.symmetric:
        out["weight_zero_point"] = _pack(zeros, fmt.bits, 0)
    if fmt.act_order:
        out["weight_g_idx"] = group_of.to(torch.int32)
    return out


def _config(fmt: Format, group: int) -> dict:
    if fmt.method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [group, group]}
    if fmt.fp8:
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "quantization_status": "compressed", "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                          "dynamic": True}}}}
    if fmt.method == "gptq":
        return {"quant_method": "gptq", "bits": fmt.bits, "group_size": group, "desc_act": fmt.act_order,
                "sym": fmt.symmetric, "checkpoint_format": "gptq"}
    if fmt.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": fmt.bits, "type": "int", "symmetric": fmt.symmetric, "dynamic": False,
               "strategy": "group" if group > 0 else "channel", "group_size": group if group > 0 else None,
               "actorder": "group" if fmt.act_order else None, "observer": "minmax"}
    activations = None if fmt.packed else {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                                           "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized" if fmt.packed else "int-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}}}
