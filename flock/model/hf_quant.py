"""Hugging Face checkpoints of quantized weights: GPTQ, AWQ, compressed-tensors (llm-compressor's pack-quantized,
int-quantized and float-quantized) and fp8. Each projection's packed integers are read as groups, w = (q - zero) *
scale over g inputs of one output row, and kept as the GGUF blocks that hold those values exactly, so that the int8
kernels of flock.model.quant run them:

- a 4-bit group of zero 8 (symmetric GPTQ, compressed-tensors) is Q4_0's d (q - 8);
- any other 4-bit group (AWQ, asymmetric GPTQ) is Q5_0's d (q5 - 16) with q5 = q - zero + 16 (in 0..31);
- an 8-bit group whose q - zero fits int8 is Q8_0's.

Blocks of 32 inputs take their group's scale. Act-order checkpoints (GPTQ's desc_act, compressed-tensors'
actorder) group inputs out of order: their columns are sorted by group once, and the layer gathers its inputs
in that order (`Groups.order`). A layer whose groups no block holds (a group not a multiple of 32 inputs, 8-bit
differences outside int8, a scale that is not a float16 value) is dequantized to floats at load, as fp8
checkpoints are (`quant_method` fp8, by blocks as DeepSeek's and Qwen's; compressed-tensors' float-quantized).
"""

import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from flock.model import quant

log = logging.getLogger("flock")

METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ packs columns 0..7 of each word in the order 0, 2, 4, 6, 1, 3, 5, 7
PACKED = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
          "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape",
                                 "input_scale", "input_zero_point")}  # static activation scales: not used
FP8 = ("weight", "weight_scale", "weight_scale_inv", "input_scale")  # weight: e4m3; an input scale is not used
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint packs its weights (its config.json's quantization_config)."""

    method: str  # one of METHODS
    bits: int
    group_size: int  # inputs per scale; -1: the whole row
    zero_offset: int = 0  # GPTQ's first format stores zero - 1
    packed: bool = True  # compressed-tensors' int-quantized: int8 weights, not packed
    fp8: bool = False  # e4m3 weights with float scales: dequantized at load (no fp8 GEMM on CPUs)
    block: tuple[int, int] | None = None  # fp8: rows and inputs of one scale

    def names(self) -> tuple[str, ...]:
        """The suffixes of a quantized projection's tensors (`.weight` too: int8 or fp8 weights)."""
        if self.fp8:
            return FP8
        return PACKED[self.method] + (() if self.packed else ("weight",))


def scheme_of(config: dict) -> Scheme:
    """The scheme of a quantization_config, or a ValueError naming what Flock cannot read."""
    method = str(config.get("quant_method", "")).lower()
    if method == "gptq":
        bits, group = config.get("bits", 4), config.get("group_size", -1)
        mixed = sorted(key for key, value in (config.get("dynamic") or {}).items()
                       if not key.startswith("-:") and isinstance(value, dict) and value.get("bits", bits) != bits)
        if mixed:
            raise ValueError(f"GPTQModel's dynamic overrides of bits per module ({mixed}) are not supported (one "
                             "bit width for every quantized module is; '-:' skips are)")
        offset = 0 if config.get("checkpoint_format", "gptq") == "gptq_v2" else 1
        scheme = Scheme("gptq", bits, group, offset)
    elif method == "awq":
        bits, group = config.get("bits", config.get("w_bit", 4)), config.get("group_size", config.get("q_group_size"))
        if str(config.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"AWQ version {config.get('version')!r} is not supported (its 'gemm' layout is)")
        scheme = Scheme("awq", bits, group if group is not None else -1)
        if bits != 4:
            raise ValueError(f"{bits}-bit AWQ is not supported (4-bit is)")
    elif method == "compressed-tensors":
        scheme = _compressed_tensors(config)
    elif method == "fp8":
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 weights of format {config['fmt']!r} are not supported (e4m3 are)")
        block = config.get("weight_block_size")
        scheme = Scheme("fp8", 8, -1, fp8=True, block=tuple(block) if block else None)
    else:
        raise ValueError(f"quantization method {method or config!r} is not supported ({', '.join(METHODS)} are)")
    if scheme.bits not in (4, 8):
        raise ValueError(f"{scheme.bits}-bit {method} weights are not supported (4 and 8 bits are)")
    return scheme


def _compressed_tensors(config: dict) -> Scheme:
    fmt = config.get("format")
    if fmt not in CT_FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported ({', '.join(CT_FORMATS)} are)")
    weights = {json.dumps(group.get("weights"), sort_keys=True) for group in config.get("config_groups", {}).values()}
    if len(weights) != 1:
        raise ValueError(f"compressed-tensors with {len(weights)} weight schemes is not supported (one is)")
    spec = json.loads(weights.pop()) or {}
    group = spec.get("group_size") if spec.get("strategy") == "group" else -1
    if fmt == "float-quantized" and spec.get("type") == "float" and spec.get("num_bits") == 8:
        block = spec.get("block_structure") if spec.get("strategy") == "block" else None
        return Scheme("compressed-tensors", 8, group or -1, fp8=True, block=tuple(block) if block else None)
    if spec.get("type", "int") != "int" or spec.get("strategy") not in ("group", "channel"):
        raise ValueError(f"compressed-tensors weights of type {spec.get('type')!r} and strategy "
                         f"{spec.get('strategy')!r} are not supported (int, by group or channel; 8-bit float)")
    return Scheme("compressed-tensors", spec.get("num_bits", 8), group or -1, packed=fmt == "pack-quantized")


@dataclass
class Groups:
    """One projection's [n, k] weight as integers: w[j, i] = (q[j, i] - zeros[j, group[i]]) * scales[j, group[i]]."""

    q: torch.Tensor  # uint8 [n, k], 0 .. 2^bits - 1
    zeros: torch.Tensor  # int16 [n, groups]
    scales: torch.Tensor  # float32 [n, groups]
    group: torch.Tensor  # int64 [k]
    bits: int

    @property
    def order(self) -> torch.Tensor | None:
        """The inputs sorted by group where an act-order checkpoint leaves them out of order (None: in order)."""
        if bool((self.group[1:] >= self.group[:-1]).all()):
            return None
        return torch.argsort(self.group, stable=True)

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 (exact: small integers times float16 scales)."""
        return (self.q.float() - self.zeros[:, self.group].float()) * self.scales[:, self.group]

    def blocks(self, order: torch.Tensor | None) -> quant.QuantTensor | None:
        """The weight's inputs in `order` as exact GGUF blocks (the module docstring's types); None where none
        holds them."""
        q, group = (self.q, self.group) if order is None else (self.q[:, order], self.group[order])
        n, k = q.shape
        if k % 32:
            return None
        firsts = group.view(-1, 32)
        if not bool((firsts == firsts[:, :1]).all()):
            return None
        block_group = firsts[:, 0]
        d = self.scales[:, block_group]
        if not bool((d.half().float() == d).all()):
            return None
        zeros = self.zeros[:, block_group]
        diff = (q.to(torch.int16).view(n, -1, 32) - zeros[..., None])
        d = d.half()
        if self.bits == 4 and bool((zeros == 8).all()):
            return _blocks("Q4_0", d, _nibbles(diff + 8))
        low, high = int(diff.min()), int(diff.max())
        if -16 <= low and high <= 15:
            v = diff + 16
            fifth = ((v >> 4).to(torch.int64) << torch.arange(32)).sum(-1).to(torch.int32)  # one bit a value
            return _blocks("Q5_0", d, fifth[..., None].view(torch.uint8), _nibbles(v))
        if -128 <= low and high <= 127:
            return _blocks("Q8_0", d, diff.to(torch.int8).view(torch.uint8))
        return None


def _nibbles(v: torch.Tensor) -> torch.Tensor:
    """GGUF's 16 bytes of a block's low 4 bits: value j in byte j's low half, value 16 + j in its high half."""
    v = (v & 15).to(torch.uint8)
    return v[..., :16] | (v[..., 16:] << 4)


def _blocks(name: str, d: torch.Tensor, *fields: torch.Tensor) -> quant.QuantTensor:
    n, count = d.shape
    scale = d.contiguous().view(torch.uint8).view(n, count, 2)
    blocks = torch.cat([scale, *fields], dim=-1).reshape(n, -1)
    return quant.QuantTensor(quant.KERNEL_TYPES[name][0], blocks.contiguous())


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 / bits values each, the first in the low bits, packed along `dim`: the values (int16)."""
    per = 32 // bits
    values = ((packed.to(torch.int32)[..., None] >> (torch.arange(per, dtype=torch.int32) * bits))
              & ((1 << bits) - 1)).to(torch.int16)
    rows, cols = packed.shape
    if dim == 1:
        return values.reshape(rows, cols * per)
    return values.permute(0, 2, 1).reshape(rows * per, cols)


def read_groups(tensors: dict[str, torch.Tensor], scheme: Scheme, k: int, where: str) -> Groups:
    """A projection's groups from its checkpoint tensors (suffix -> tensor) of an [n, k] weight."""
    try:
        q, zeros, scales, group = _READERS[scheme.method](tensors, scheme, k)
    except KeyError as e:
        raise ValueError(f"{where}: {scheme.method} tensor {e.args[0]!r} is missing") from None
    n = q.shape[0]
    size = scheme.group_size if scheme.group_size > 0 else k
    groups = -(-k // size)  # as the config says, as vLLM sizes the scales
    group = group.to(torch.int64) if group is not None else torch.arange(k) // size
    if q.shape[1] != k or scales.shape != (n, groups) or zeros.shape != scales.shape or group.shape != (k,) \
            or int(group.min()) < 0 or int(group.max()) >= scales.shape[1]:
        raise ValueError(f"{where}: {scheme.method} tensors of shapes {_shapes(tensors)} do not make a [{n}, {k}] "
                         f"weight of groups of {scheme.group_size}")
    return Groups(q.to(torch.uint8), zeros.to(torch.int16), scales.float(), group, scheme.bits)


def fp8_values(tensors: dict[str, torch.Tensor], scheme: Scheme, where: str) -> torch.Tensor:
    """An fp8 projection's weight as float32: its e4m3 values times their scales, one for the tensor, a row, a
    group of inputs or a block of rows and inputs (`weight_scale_inv` multiplies too, as its readers apply it)."""
    scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
    if "weight" not in tensors or scale is None:
        raise ValueError(f"{where}: an fp8 weight needs 'weight' and 'weight_scale' (or 'weight_scale_inv')")
    w, scale = tensors["weight"].float(), scale.float()
    n, k = w.shape
    scale = scale.reshape(scale.shape[0], -1) if scale.dim() else scale.view(1, 1)
    rows, cols = scheme.block or (-(-n // scale.shape[0]), -(-k // scale.shape[1]))
    expanded = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    if expanded.shape != (n, k):
        raise ValueError(f"{where}: fp8 scales of shape {tuple(scale.shape)} do not cover a [{n}, {k}] weight")
    return w * expanded


def _shapes(tensors: dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{name} {tuple(t.shape)}" for name, t in tensors.items())


def _gptq(t: dict, scheme: Scheme, k: int):
    """qweight [k / per, n] packed along the inputs; qzeros [groups, n / per] along the outputs."""
    q = unpack(t["qweight"], scheme.bits, 0).T
    n = q.shape[0]
    zeros = unpack(t["qzeros"], scheme.bits, 1)[:, :n].T + scheme.zero_offset
    return q, zeros, t["scales"].T, t.get("g_idx")


def _awq(t: dict, scheme: Scheme, k: int):
    """qweight [k, n / 8] and qzeros [groups, n / 8] packed along the outputs in AWQ's column order."""
    q, zeros = (_awq_columns(unpack(t[name], 4, 1)) for name in ("qweight", "qzeros"))
    return q.T, zeros.T, t["scales"].T, None


def _awq_columns(values: torch.Tensor) -> torch.Tensor:
    rows, cols = values.shape
    return values.view(rows, cols // 8, 8)[:, :, list(AWQ_COLUMNS)].reshape(rows, cols)


def _compressed(t: dict, scheme: Scheme, k: int):
    """weight_packed [n, k / per] along the inputs, weight_zero_point [n / per, groups] along the outputs, both
    stored as value + 2^(bits - 1); int-quantized: int8 weights and zero points. Values here are unsigned."""
    offset = 1 << (scheme.bits - 1)
    if scheme.packed:
        q = unpack(t["weight_packed"], scheme.bits, 1)[:, :k]
    else:
        q = t["weight"].to(torch.int16) + offset
    n, scales = q.shape[0], t["weight_scale"].reshape(q.shape[0], -1)
    if "weight_zero_point" not in t:
        zeros = torch.full(scales.shape, offset, dtype=torch.int16)
    elif scheme.packed:
        zeros = unpack(t["weight_zero_point"], scheme.bits, 0)[:n]
    else:
        zeros = t["weight_zero_point"].reshape(scales.shape).to(torch.int16) + offset
    return q, zeros, scales, t.get("weight_g_idx")


_READERS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed}


def packed_weights(model, folder: Path, scheme: Scheme, slots: dict) -> set[str]:
    """The weights (as `slots` names them: `model.layers.0.mlp.up_proj.weight`) a checkpoint stores packed."""
    from safetensors import safe_open

    from flock.model.loader import safetensors_files, slot_name

    marker = ".weight_scale" if scheme.method == "compressed-tensors" else ".qweight"
    found = set()
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            found |= {slot_name(name.removesuffix(marker) + ".weight", slots, model)
                      for name in f.keys() if name.endswith(marker)}
    return found


def quantized_layers(model, folder: Path, scheme: Scheme) -> list[str]:
    """The projections whose every part the checkpoint stores packed, in groups blocks can hold (a multiple of
    32 inputs): `load_packed` keeps them quantized unless their values rule it out."""
    from flock.model.linear import Linear
    from flock.model.loader import hf_tensor_slots, layer_parts

    if scheme.fp8:
        return []
    slots, modules = hf_tensor_slots(model), dict(model.named_modules())
    packed, fits = packed_weights(model, folder, scheme, slots), scheme.group_size == -1 or scheme.group_size % 32 == 0
    return [layer for layer, parts in layer_parts(model, slots).items()
            if isinstance(modules[layer], Linear) and fits and modules[layer].in_features % 32 == 0
            and all(p in packed for p in parts)]


def load_packed(model, slots: dict, packed: dict[str, dict[str, torch.Tensor]], scheme: Scheme,
                in_blocks, where: str) -> set[str]:
    """Put the packed projections (weight name -> its tensors by suffix) into `model`: those of `in_blocks` as
    blocks where their values allow, the others dequantized into their float weights. Returns the names loaded."""
    from flock.model.loader import copy_into, layer_parts

    modules, weights, expanded, loaded = dict(model.named_modules()), {}, [], set()
    for layer, parts in layer_parts(model, slots).items():
        mine = [p for p in parts if p in packed]
        if not mine:
            continue
        loaded.update(mine)
        if scheme.fp8:
            for p in mine:
                copy_into(slots[p], fp8_values(packed.pop(p), scheme, f"{where}: {p}"), p, where)
            continue
        module = modules[layer]
        groups = {p: read_groups(packed.pop(p), scheme, module.in_features, f"{where}: {p}") for p in mine}
        weight = _weight([groups[p] for p in parts]) if layer in in_blocks else None
        if weight is not None:
            weights[layer] = weight
            continue
        if layer in in_blocks:  # its float weight was never allocated
            module.weight.data = torch.empty((module.out_features, module.in_features), dtype=module.weight.dtype)
            expanded.append(layer)
        for p, g in groups.items():
            copy_into(slots[p], g.dequantize(), p, where)
    if packed:
        raise ValueError(f"{where}: unexpected quantized tensor {next(iter(packed))!r} for {model.config.model_type}")
    if expanded:
        log.info("%s: %d projections are dequantized at load (no GGUF block holds their groups exactly): %s", where,
                 len(expanded), ", ".join(expanded[:3]) + (" ..." if len(expanded) > 3 else ""))
    model.use_quantized(weights)
    return loaded


def _weight(groups: list[Groups]) -> quant.QuantWeight | None:
    """The parts of one projection as blocks (stacked on rows, runs of one type interleaved together), or None."""
    order = groups[0].order
    if any(not _same_order(g.order, order) for g in groups[1:]):
        return None
    parts = [g.blocks(order) for g in groups]
    if any(p is None for p in parts):
        return None
    runs = itertools.groupby(parts, key=lambda p: p.qtype)
    return quant.QuantWeight([quant.for_kernels(quant.QuantTensor(qtype, torch.cat([p.blocks for p in run])))
                              for qtype, run in runs], order)


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
