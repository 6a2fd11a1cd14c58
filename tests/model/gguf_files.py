"""Write GGUF files the way llama.cpp's convert_hf_to_gguf.py does, from the random Hugging Face folders of
tests/conftest.py, so GGUF loading is tested without a downloaded model."""

import json
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from flock.model.builtin import CHAT_TEMPLATE
from flock.model.gguf import GRANITE_SCALES

Q = gguf.GGMLQuantizationType


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's row order for q/k of Llama: rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: Path, path: Path, qtype: Q = Q.F32, tensor_types: dict[str, Q] | None = None,
               metadata: dict[str, str | int | float] | None = None, rope_freqs: np.ndarray | None = None,
               pre: str = "default", add_bos: bool | None = False) -> Path:
    """The model of `folder` (config.json, model.safetensors, tokenizer.json) as a GGUF file: matrices stored as
    `qtype` (or as `tensor_types[name]`), vectors as F32; llama q/k rows permuted; extra `metadata` keys;
    llama3 rope scaling as llama.cpp's rope_freqs tensor (or the given one)."""
    config = json.loads((folder / "config.json").read_text())
    arch = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
            "mixtral": "llama"}.get(config["model_type"], config["model_type"])
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(config.get("rope_theta") or rope.get("full_attention", rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope_share = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    writer.add_rope_dimension_count(int(head_dim * rope_share))  # convert_hf_to_gguf.py's rotary dims
    if config.get("head_dim"):  # as convert_hf_to_gguf.py writes it
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    _add_tokenizer(writer, folder, pre, add_bos)
    for key, value in (metadata or {}).items():
        add = writer.add_string if isinstance(value, str) else writer.add_uint32 if isinstance(value, int) else \
            writer.add_float32
        add(key, value)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    _add_experts(writer, arch, config)
    for hf_name, w in _merged_experts(load_file(str(folder / "model.safetensors"))).items():
        module, _, kind = hf_name.rpartition(".")
        gguf_name = f"{names.get_name(module)}.{kind}"
        if arch in ("llama", "granite", "smollm3") and module.endswith(("q_proj", "k_proj")):
            w = llama_cpp_permute(w, heads if module.endswith("q_proj") else config["num_key_value_heads"])
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            w = w + 1  # convert_hf_to_gguf.py's: Gemma's norms as 1 + weight
        quantized = w.ndim >= 2 and "ffn_gate_inp" not in gguf_name  # llama-quantize keeps routers in floats
        kind_type = (tensor_types or {}).get(gguf_name, qtype if quantized else Q.F32)
        w = w.astype(np.float32)
        if kind_type in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name, w.astype(np.float16 if kind_type == Q.F16 else np.float32))
        else:
            writer.add_tensor(gguf_name, _quantize(w, kind_type), raw_dtype=kind_type)
    factors = llama3_rope_factors(config) if rope_freqs is None else rope_freqs
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    if arch == "phi3":
        _add_phi3(writer, config)
    if arch in ("gemma2", "gemma3"):
        _add_gemma(writer, arch, config)
    for name, key in GRANITE_SCALES.items() if arch == "granite" else ():  # convert_hf_to_gguf.py's
        writer.add_float32(f"granite.{key}", config[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_phi3(writer: gguf.GGUFWriter, config: dict) -> None:
    """convert_hf_to_gguf.py's Phi-3 keys: the sliding window (0: none), LongRoPE's lengths, factors and scale;
    a padding id (transformers' Phi-3 default, 32000, lies outside the tiny vocabulary)."""
    writer.add_sliding_window(config.get("sliding_window") or 0)
    writer.add_pad_token_id(0)
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if scaling.get("rope_type") != "longrope":
        return
    original = scaling.get("original_max_position_embeddings") or config["original_max_position_embeddings"]
    scale = config["max_position_embeddings"] / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(original)) if scale > 1 else 1.0)
    writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))


def _add_experts(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    """convert_hf_to_gguf.py's expert keys (Mixtral, a `llama` file, and Qwen's mixtures)."""
    experts = config.get("num_local_experts") or config.get("num_experts")
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _merged_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's experts' tensors stacked into one [experts, rows, cols] tensor, as convert_hf_to_gguf.py
    merges them (`...experts.gate_proj.weight`)."""
    out, groups = {}, {}
    for name, w in tensors.items():
        found = re.search(r"\.experts\.(\d+)\.", name)
        if found is None:
            out[name] = w
        else:
            groups.setdefault(name[: found.start()] + ".experts." + name[found.end() :], {})[int(found[1])] = w
    return out | {name: np.stack([parts[e] for e in sorted(parts)]) for name, parts in groups.items()}


def _add_gemma(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    """convert_hf_to_gguf.py's Gemma 2 and 3 keys: the caps, the window; Gemma 3's global rope scaling; and (as
    newer llama.cpp files may) the layers' pattern as a flag per layer and the local layers' rope base."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key):
            writer.add_float32(f"{arch}.{key}", config[key])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_array(f"{arch}.attention.sliding_window_pattern",
                     [t == "sliding_attention" for t in config["layer_types"]])
    full = (config.get("rope_parameters") or {}).get("full_attention", {})
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if arch == "gemma3":
        writer.add_float32("gemma3.rope.freq_base_swa", config["rope_parameters"]["sliding_attention"]["rope_theta"])


def llama3_rope_factors(config: dict) -> np.ndarray | None:
    """convert_hf_to_gguf.py's rope_freqs tensor for a "llama3" rope scaling: a divisor per frequency."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if scaling.get("rope_type") != "llama3":
        return None
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    dim = config["hidden_size"] // config["num_attention_heads"]
    old_len, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


LATTICE = (Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_M)  # flock.model.iq_grids rewrites them
# byte offsets of a block's float16 scales
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks of float rows [..., k] (k a multiple of 256), which the gguf package cannot write: each 32
    weights' scale maps the largest of them to the table's -127, a 256-block's 6-bit scales share its d, and each
    weight takes the nearest value of the table."""
    values = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)
    subs = w.reshape(-1, 32).astype(np.float32)
    scale = (subs[np.arange(len(subs)), np.abs(subs).argmax(1)] / -127).reshape(-1, 8)
    d = (np.abs(scale).max(1) / 31).astype(np.float16)
    ls = np.clip(np.round(scale / np.where(d > 0, d, 1).astype(np.float32)[:, None]), -32, 31).astype(np.int64)
    dl = (d.astype(np.float32)[:, None] * ls).reshape(-1, 1, 1)
    idx = np.abs(subs[:, :, None] - dl * values).argmin(-1).astype(np.uint8).reshape(-1, 8, 32)
    u = (ls + 32).astype(np.uint16)
    out = np.zeros((len(d), 136), np.uint8)
    out[:, 0:2] = d.reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = ((u >> 4) << (2 * np.arange(8))).sum(1).astype(np.uint16).reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = (u[:, 0::2] & 15) | (u[:, 1::2] & 15) << 4
    out[:, 8:] = (idx[:, :, :16] | idx[:, :, 16:] << 4).reshape(-1, 128)
    return out.reshape(*w.shape[:-1], -1)


def _quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf's quantizer (quantize_iq4_xs for IQ4_XS); for the K-quants, IQ4_NL and the lattice IQ types, which it
    cannot write, random blocks (weights unrelated to w, of its size); zero blocks for other types it cannot write."""
    if qtype == Q.IQ4_XS:
        return quantize_iq4_xs(w)
    try:
        return gguf.quants.quantize(w, qtype)
    except (NotImplementedError, gguf.quants.QuantError):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if qtype in K_QUANT_SCALES or qtype in (Q.IQ4_NL, *LATTICE):
            rows = random_blocks(qtype, int(np.prod(w.shape[:-1])), w.shape[-1], float(np.abs(w).mean()))
            return rows.reshape(*w.shape[:-1], -1)  # a mixture's [experts, rows, cols] too
        return np.zeros((*w.shape[:-1], w.shape[-1] // block * size), np.uint8)


def random_blocks(qtype: Q, rows: int, k: int, size: float = 0.05, seed: int = 0) -> np.ndarray:
    """Random bytes as blocks of `qtype` (any bytes are valid blocks but their float16 scales), [rows, bytes],
    scaled so the weights' mean size is about `size`."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed + rows + k)
    blocks = rng.integers(0, 256, (rows, k // block, nbytes), dtype=np.uint8)
    if qtype == Q.IQ1_M:  # its d: the top nibbles of its 4 uint16 scale words
        d = rng.uniform(-1, 1, (rows, k // block)).astype(np.float16)
        d *= np.float16(size / np.abs(gguf.quants.dequantize(iq1_m_with_d(blocks, d), qtype)).mean())
        return iq1_m_with_d(blocks, d).reshape(rows, -1)
    for at in K_QUANT_SCALES.get(qtype, (0, 2) if qtype in (Q.Q4_1, Q.Q5_1) else (0,)):
        scales = rng.uniform(-1, 1, (rows, k // block)).astype(np.float16)
        blocks[:, :, at:at + 2] = scales.view(np.uint8).reshape(rows, k // block, 2)
    out = blocks.reshape(rows, -1)
    mean = np.abs(gguf.quants.dequantize(out, qtype)).mean()
    for at in K_QUANT_SCALES.get(qtype, (0, 2) if qtype in (Q.Q4_1, Q.Q5_1) else (0,)):
        scales = blocks[:, :, at:at + 2].copy().view(np.float16) * np.float16(size / mean)
        blocks[:, :, at:at + 2] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def iq1_m_with_d(blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    """IQ1_M blocks [..., 56] with their fp16 d set to `d` [...] (nibble k of d the top nibble of scale word k)."""
    out = blocks.copy()
    words = out[..., 48:56].copy().view(np.uint16)
    nibbles = (d.view(np.uint16)[..., None] >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(15)
    out[..., 48:56] = ((words & np.uint16(0x0FFF)) | nibbles << np.uint16(12)).view(np.uint8)
    return out


def q3_k_layout_values(blocks: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The weights of Q3_K's blocks ([rows, blocks x 110]) whose 3-bit indices pick from `values`, in float64."""
    b = blocks.reshape(-1, 110)
    d = b[:, 108:110].copy().view(np.float16)[:, 0].astype(np.float64)
    t = np.arange(16)
    low, high = (b[:, 96 + t % 8] >> (4 * (t // 8))) & 15, (b[:, 104 + t % 4] >> (2 * (t // 4))) & 3
    scales = (low | high << 4).astype(np.int64)
    i = np.arange(256)
    h, j, l = i // 128, i % 128 // 32, i % 32
    idx = (b[:, 32 + 32 * h + l] >> (2 * j)) & 3 | ((b[:, l] >> (4 * h + j)) & 1) << 2
    weights = d[:, None] * (scales - 32)[:, i // 16] * values.astype(np.int64)[idx]
    return weights.reshape(len(blocks), -1)


def iq4_xs_layout_values(blocks: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The weights of IQ4_XS's blocks ([rows, blocks x 136]) whose indices pick from `values`, in float64."""
    b = blocks.reshape(-1, 136)
    d = b[:, :2].copy().view(np.float16)[:, 0].astype(np.float64)
    high, low, j = b[:, 2:4].copy().view(np.uint16), b[:, 4:8], np.arange(8)
    scales = ((low[:, j // 2] >> (4 * (j % 2))) & 15 | ((high >> (2 * j)) & 3) << 4).astype(np.int64) - 32
    q = b[:, 8:].reshape(-1, 8, 16)
    idx = np.concatenate([q & 15, q >> 4], axis=2)  # weight i of each 32: byte i % 16's low or high nibble
    return (d[:, None, None] * scales[:, :, None] * values.astype(np.int64)[idx]).reshape(len(blocks), -1)


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path, pre: str, add_bos: bool | None) -> None:
    """The built-in byte-level BPE tokenizer as llama.cpp stores a "gpt2" vocabulary (`pre`: its pre-tokenizer;
    `add_bos` None: no tokenizer.ggml.add_bos_token key)."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"] | {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_spm_gguf(path: Path) -> Path:
    """A GGUF file with only a small SentencePiece ("llama") vocabulary: pieces, their letters, byte fallback."""
    writer = gguf.GGUFWriter(str(path), "llama")
    pieces = ["▁the", "▁cat", "▁sat", "▁on", "▁a", "at", "th", "he", "▁t", "▁c", "▁s", "on"]
    letters = sorted({ch for p in pieces for ch in p} - set(pieces))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *pieces, *letters]
    T = gguf.TokenType
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])
    writer.add_token_types([T.UNKNOWN, T.CONTROL, T.CONTROL, *[T.BYTE] * 256, *[T.NORMAL] * (len(tokens) - 259)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    return path


def write_metadata_only(path: Path, arch: str) -> Path:
    """A valid GGUF with no tensors, for errors raised while reading the config."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
