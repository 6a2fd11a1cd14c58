"""GGUF checkpoints (the llama.cpp / Ollama format): the config and the weights, quantized ones kept in their
blocks where Flock has kernels for their type (flock.model.quant; IQ4_NL and the lattice IQ types rewritten as Q8_0's
and IQ4_XS's blocks of the same values), the rest dequantized at load (the tokenizer: flock/tokenizer.py).

The file is read with the `gguf` package (llama.cpp's reader; the config and tensor table it gives are kept on
disk, `gguf_table`) and converted the way `transformers` converts it: its config-key mapping, the gguf package's
tensor-name table, and llama.cpp's q/k row permutation undone as transformers undoes it (tests check it
against transformers loading the same file).
"""

import functools
import itertools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from flock.model import gguf_table

if TYPE_CHECKING:
    from gguf import ReaderTensor

# llama.cpp's names for the architectures Flock runs (it writes Mistral as "llama")
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM", "gemma": "GemmaForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
# transformers' model_type where it is not llama.cpp's name (a `llama` file with experts is Mixtral)
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# the experts' keys (after the architecture's name) -> config names; llama.cpp renormalizes Qwen3-MoE's and
# Mixtral's top k weights, not Qwen2-MoE's
MOE_KEYS = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
            "expert_feed_forward_length": "moe_intermediate_size",
            "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
GEMMA = ("gemma", "gemma2", "gemma3")  # their norms stored as 1 + weight (convert_hf_to_gguf.py adds the 1)
# Gemma 2's and 3's sliding-window layers by default: all but every 2nd / 6th (llama.cpp's swa pattern), and
# their layer counts at 27B, where q k^T is scaled by hidden / heads rather than head_dim (llama.cpp's rule)
GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# architectures whose q/k rows convert_hf_to_gguf.py interleaves (LlamaModel's)
PERMUTED_QK = ("llama", "granite", "smollm3")
# Granite's multipliers: config name -> GGUF key (after the architecture's name)
GRANITE_SCALES = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                  "logits_scaling": "logit_scale", "attention_multiplier": "attention.scale"}
ROPE_SCALING_TYPES = ("none", "linear", "yarn")
EXPERT = re.compile(r"\.experts\.(\d+)(?=\.)")
FLOATS = ("F32", "F16", "BF16", "F64")
ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling, stored as per-frequency divisors
LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE
CONFIG_TENSORS = (ROPE_FREQS, *LONGROPE_FACTORS)  # read into the config's rope_scaling, not into weights
REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
# the token texts llama.cpp ends generation at, whatever their type (llama-vocab.cpp): how chat formats end a
# turn, a message or a text
END_OF_GENERATION = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                     "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                     "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                     "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["}
# and at a code model's FIM pad, repository and file-separator tokens: the file's ids, else the first of these
FIM_ENDS = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
            "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
            "fim_sep": ("<|file_sep|>",)}

log = logging.getLogger("flock")


@dataclass(frozen=True)
class GGUFCheckpoint:
    path: Path
    tensors: list["ReaderTensor | gguf_table.Tensor"]  # not the metadata fields: a vocabulary's are ~100 MB
    config: dict  # as a Hugging Face config.json would hold it

    @property
    def architecture(self) -> str:
        """llama.cpp's name of the architecture."""
        return llama_cpp_architecture(self.config["model_type"])


def llama_cpp_architecture(model_type: str) -> str:
    """llama.cpp's name of a Hugging Face model type."""
    if model_type == "mixtral":
        return "llama"
    return next((arch for arch, t in MODEL_TYPES.items() if t == model_type), model_type)


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: any file, or the single *.gguf of a folder that has no config.json."""
    if path.is_file():
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); name one of them")
    return files[0] if files else None


def read_gguf(path: Path) -> GGUFCheckpoint:
    """Parse the file's metadata and tensor table (cached while the file is unchanged)."""
    st = path.stat()
    return _read(str(path.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _read(path: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
    from gguf import GGUFReader

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    cached = gguf_table.load(path, mtime_ns, size)
    if cached is not None:
        return GGUFCheckpoint(Path(path), *cached)
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise ValueError(f"{path} is truncated or corrupt, the gguf reader failed: {e}") from None
    ckpt = GGUFCheckpoint(Path(path), split_experts(reader.tensors), hf_config(reader, path))
    gguf_table.save(path, mtime_ns, size, ckpt.tensors, ckpt.config)
    return ckpt


def split_experts(tensors: list) -> list:
    """Each 3D tensor of experts (llama.cpp's `ffn_*_exps`, [experts, rows, row bytes]) as one 2D tensor an expert,
    named `{name}#{expert}`: an expert then loads, or stays in its blocks, as any projection does."""
    from flock.model.gguf_table import Tensor

    out = []
    for t in tensors:
        if t.data.ndim != 3:
            out.append(t)
            continue
        size = int(t.n_bytes) // t.data.shape[0]
        out += [Tensor(f"{t.name}#{e}", t.tensor_type, int(t.data_offset) + e * size, size, t.data[e])
                for e in range(t.data.shape[0])]
    return out


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config(reader, path: str) -> dict:
    """A Hugging Face config dict from the metadata, through transformers' GGUF key mapping."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (Flock runs "
                         f"{', '.join(GGUF_ARCHITECTURES)}: Llama, Mistral, Mixtral, Qwen2, Qwen3, their MoEs, Phi-3, "
                         "Granite, Gemma and SmolLM3 models)")
    tensors = {t.name for t in reader.tensors}
    mixtral = arch == "llama" and _field(reader, "llama.expert_count", 0)
    model_type = "mixtral" if mixtral else MODEL_TYPES.get(arch, arch)
    architecture = "MixtralForCausalLM" if model_type == "mixtral" else GGUF_ARCHITECTURES[arch]
    config = {"architectures": [architecture], "model_type": model_type}
    keys = GGUF_CONFIG_MAPPING.get(arch, GGUF_CONFIG_MAPPING["llama"])  # Granite's are Llama's and its scales
    mapping = {name: f"{arch}.{key}" for key, name in keys.items() if name}
    mapping |= {name: f"{arch}.{key}" for key, name in MOE_KEYS.items()}
    mapping |= {name: f"{arch}.{key}" for name, key in GRANITE_SCALES.items()} if arch == "granite" else {}
    mapping["head_dim"] = f"{arch}.attention.key_length"  # when heads are not hidden_size / heads wide (Qwen3)
    for name, key in mapping.items():
        if key in reader.fields:
            config[name] = _field(reader, key)
    missing = [mapping[name] for name in REQUIRED if name not in config]
    if missing or "tokenizer.ggml.tokens" not in reader.fields:
        raise ValueError(f"{path}: the metadata has no {(missing or ['tokenizer.ggml.tokens'])[0]}")
    config.setdefault("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))
    config["tie_word_embeddings"] = "output.weight" not in tensors  # llama.cpp drops a tied output matrix
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    for name, key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in reader.fields:
            config[name] = _field(reader, f"tokenizer.ggml.{key}")
    config["eos_token_id"] = end_of_generation_ids(reader)
    if "num_experts" in config:
        config["norm_topk_prob"] = model_type != "qwen2_moe"
        if model_type == "mixtral":
            config["num_local_experts"] = config.pop("num_experts")
    config["torch_dtype"] = _file_dtype(reader)
    _rope_scaling(reader, arch, tensors, config, path)
    return config


def end_of_generation_ids(reader) -> list[int]:
    """The tokens generation stops at, as llama.cpp stops (its end-of-generation set): the file's EOS,
    end-of-turn and end-of-message ids, a code model's FIM pad, repository and file separator, and every token
    whose text a chat format ends with (a Qwen2 file whose EOS is <|endoftext|> still ends its turns with
    <|im_end|>); harmony's <|end|> and a normal </s> aside, as llama.cpp sets them aside."""
    fields, tokens = reader.fields, reader.fields["tokenizer.ggml.tokens"]
    texts = [bytes(tokens.parts[i]).decode(errors="replace") for i in tokens.data]
    ids = {_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom", *FIM_ENDS)
           if f"tokenizer.ggml.{key}_token_id" in fields}
    for key, names in FIM_ENDS.items():
        if f"tokenizer.ggml.{key}_token_id" not in fields:
            ids |= set([i for i, t in enumerate(texts) if t in names][:1])
    ids |= {i for i, t in enumerate(texts) if t in END_OF_GENERATION}
    by_text = {texts[i]: i for i in ids if 0 <= i < len(texts)}
    if "<|end|>" in by_text and ("<|call|>" in by_text or "<|calls|>" in by_text) and \
            ("<|return|>" in by_text or "<|flush|>" in by_text):
        ids.discard(by_text["<|end|>"])
    if "</s>" in by_text and ("<|tool_response>" in by_text or "<|plamo:eos|>" in by_text):
        ids.discard(by_text["</s>"])
    return sorted(ids)


# BPE pre-tokenizers whose vocabularies llama.cpp adds a BOS to unless the file says otherwise
BOS_BY_DEFAULT = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                  "jina-v5-nano", "tekken", "chameleon")


def split_as_llama_cpp(tokenizer, path: Path) -> None:
    """Make the tokenizer transformers converted from the file split text as llama.cpp does (the converted one is
    kept, and this file's code names the kept copy, so a change here converts again).
    - A SentencePiece vocabulary: every piece of text between special tokens gets the leading "▁" (unless
      tokenizer.ggml.add_space_prefix says not to) and spaces become "▁", as in Llama 2's and Mistral's own
      tokenizer.json; transformers' Metaspace prefixed the first piece only and none already starting with a
      space (" Hello", or "[INST]" after "<s>", came out as other ids).
    - SmolLM's BPE ("smollm"): every numeric character alone, as its own tokenizer.json (Digits before the
      byte-level split; " ½" was one piece).
    - Llama 3's BPE ("llama-bpe"): a word the vocabulary holds whole is that one token (`ignore_merges`, as in its
      tokenizer.json; "Cửa Việt" came out in 5 tokens instead of 3).
    - A BOS where the file does not say (no tokenizer.ggml.add_bos_token), as llama.cpp's defaults for the
      vocabulary add one (SentencePiece, Llama 3's and a few other BPEs'; older Llama 3 files lack the key, and
      transformers added none).
    - No token past the file's vocabulary: transformers adds "<|endoftext|>" after a Llama 3 one (id 128256, which
      the model has no row for, so a prompt with that text was refused); it is text, as for llama.cpp."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer, normalizers, pre_tokenizers

    backend = tokenizer.backend_tokenizer
    spm = isinstance(backend.pre_tokenizer, pre_tokenizers.Metaspace)
    reader = GGUFReader(path)
    if spm:
        steps = [normalizers.Prepend("▁")] if _field(reader, "tokenizer.ggml.add_space_prefix", True) else []
        backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
        backend.pre_tokenizer = None
    elif _field(reader, "tokenizer.ggml.pre") == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         backend.pre_tokenizer])
    elif _field(reader, "tokenizer.ggml.pre") == "llama-bpe":
        backend.model.ignore_merges = True  # Llama 3's: a word in the vocabulary is one token, whatever the merges
    if _field(reader, "tokenizer.ggml.add_bos_token") is None and (spm or _field(reader, "tokenizer.ggml.pre") in
                                                                    BOS_BY_DEFAULT) and tokenizer.bos_token:
        tokenizer.add_bos_token = True
    data, vocab = json.loads(backend.to_str()), len(reader.fields["tokenizer.ggml.tokens"].data)
    inside = [t for t in data["added_tokens"] if t["id"] < vocab]
    if len(inside) < len(data["added_tokens"]):
        tokenizer._tokenizer = Tokenizer.from_str(json.dumps(data | {"added_tokens": inside}))


def _rope_scaling(reader, arch: str, tensors: set[str], config: dict, path: str) -> None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"{path}: rope scaling of type {kind!r} is not supported for GGUF files (none, linear, "
                         "yarn, or llama3 as per-frequency factors)")
    if kind == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    if kind == "yarn":  # as convert_hf_to_gguf.py writes transformers' rope_scaling
        config["rope_scaling"] = {"rope_type": "yarn", "factor": _field(reader, f"{arch}.rope.scaling.factor"),
                                  "original_max_position_embeddings":
                                      _field(reader, f"{arch}.rope.scaling.original_context_length")}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            if (value := _field(reader, f"{arch}.rope.scaling.{key}")) is not None:
                config["rope_scaling"][name] = value
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotary = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:  # Phi-4-mini's: the rotary embedding turns part of each head
        config["partial_rotary_factor"] = rotary / head_dim
    if ROPE_FREQS in tensors:  # how convert_hf_to_gguf.py writes Llama 3.1+'s "llama3" rope scaling
        config["rope_scaling"] = llama3_scaling(np.asarray(_tensor(reader, ROPE_FREQS), dtype=np.float64),
                                                config.get("rope_theta", 10000.0), head_dim, path)
    if arch == "phi3":
        _phi3(reader, tensors, config)
    if arch in GEMMA_WINDOW_PATTERN:
        _gemma(reader, arch, config, head_dim)


def _phi3(reader, tensors: set[str], config: dict) -> None:
    """Phi-3's sliding window (0: none, as Phi-4 writes it) and LongRoPE, as convert_hf_to_gguf.py writes them."""
    config["sliding_window"] = _field(reader, "phi3.attention.sliding_window", 0) or None
    original = _field(reader, "phi3.rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = original
    if set(LONGROPE_FACTORS) <= tensors:
        long, short = (_tensor(reader, name).tolist() for name in LONGROPE_FACTORS)
        config["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                                  "attention_factor": _field(reader, "phi3.rope.scaling.attn_factor")}


def _gemma(reader, arch: str, config: dict, head_dim: int) -> None:
    """Gemma 2's and 3's keys as llama.cpp reads them: the caps, the window (none for a Gemma 3 file without
    one) and the layers it applies to (a pattern, or a flag per layer), Gemma 3's local rope base (10,000 unless
    set), q k^T's scale (llama.cpp's rule: at 27B by hidden / heads, else by head_dim)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"{arch}.{key}" in reader.fields:
            config[key] = _field(reader, f"{arch}.{key}")
    window = _field(reader, f"{arch}.attention.sliding_window", 0)
    config["sliding_window"] = window or (4096 if arch == "gemma2" else None)  # llama.cpp's defaults
    layers = config["num_hidden_layers"]
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", GEMMA_WINDOW_PATTERN[arch])
    sliding = ([bool(s) for s in pattern] if isinstance(pattern, list) else
               [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)])
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    big = layers == GEMMA_27B_LAYERS[arch]
    config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if big else head_dim
    if arch == "gemma3":
        config["rope_local_base_freq"] = _field(reader, "gemma3.rope.freq_base_swa", 10000.0)


def _tensor(reader, name: str) -> np.ndarray:
    return np.asarray(next(t for t in reader.tensors if t.name == name).data)


def llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, path: str) -> dict | None:
    """The "llama3" rope_scaling whose per-frequency divisors are `factors` (None if they are all 1).

    Between the high-frequency end (divisor 1) and the low one (divisor `factor`) a divisor f gives
    s = (1/f - 1/factor) / (1 - 1/factor), linear in x = 1 / wavelength: s = a x - b, with
    a = old_len / (high - low) and b = low / (high - low). Only a and b matter, so low_freq_factor = 1
    fixes the rest; with fewer than two frequencies in the band, any line through them that keeps the others
    outside it gives the same divisors. The result is checked against the factors."""
    from flock.model.config import ModelConfig
    from flock.model.rope import inv_frequencies

    factor = float(factors.max())
    if factor <= 1.0:
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if len(factors) == len(inv_freq):
        a, b = _llama3_line(inv_freq / (2 * np.pi), factors, factor)
        if a > 0 and b > 0:
            scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                       "high_freq_factor": float(1 + 1 / b), "original_max_position_embeddings": float(a / b)}
            fitted = inv_frequencies(ModelConfig("llama", 1, 1, 1, 1, 1, 1, head_dim, rope_theta=theta,
                                                 rope_scaling=scaling)).double().numpy()
            if np.allclose(fitted, inv_freq / factors, rtol=1e-4, atol=0):
                return scaling
    raise ValueError(f"{path}: its per-frequency rope factors ({ROPE_FREQS}) are not Llama 3's rope scaling")


def _llama3_line(x: np.ndarray, factors: np.ndarray, factor: float) -> tuple[float, float]:
    """(a, b) of s = a x - b through the band's points, s <= 0 at every divisor `factor`, s >= 1 at every 1."""
    band = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    s = (1 / factors - 1 / factor) / (1 - 1 / factor)
    if band.sum() >= 2:
        slope, intercept = np.polyfit(x[band], s[band], 1)
        return slope, -intercept
    below = x[factors >= factor * (1 - 1e-6)].max(initial=0.0)  # the low-frequency end lies above this
    above = x[factors <= 1 + 1e-6].min(initial=2 * x.max())  # the high-frequency end at most this
    if band.sum() == 1:
        x1, s1 = x[band][0], s[band][0]
        gap = min((x1 - below) / 2, (above - x1) * s1 / (1 - s1) / 2)  # x1 - (where s = 0)
        return s1 / gap, s1 / gap * (x1 - gap)
    zero, one = below + (above - below) / 3, below + 2 * (above - below) / 3
    return 1 / (one - zero), zero / (one - zero)


def _file_dtype(reader) -> str:
    """The float type of a file of floats; bfloat16 for quantized weights (their precision is far lower)."""
    from gguf import GGMLQuantizationType as T

    types = {t.tensor_type for t in reader.tensors}
    if not types <= {T.F32, T.F16, T.BF16}:
        return "bfloat16"
    return "bfloat16" if T.BF16 in types else "float16" if T.F16 in types else "float32"


def quantized_layers(model, ckpt: GGUFCheckpoint) -> dict[str, list[str]]:
    """The projections and the embedding whose every part the file stores in a type the int8 kernels take:
    module name -> its GGUF tensor names in row order. `load_gguf_weights` keeps them quantized."""
    from flock.model.loader import hf_tensor_slots, layer_parts
    from flock.model.quant import BLOCK_TYPES

    slots = hf_tensor_slots(model)
    names = gguf_to_hf_names(ckpt.architecture, model.config.num_hidden_layers, slots)
    tensors = {names[t.name]: t for t in ckpt.tensors if t.name in names}
    return {layer: [tensors[p].name for p in parts] for layer, parts in layer_parts(model, slots).items()
            if all(p in tensors and int(tensors[p].tensor_type) in BLOCK_TYPES
                   and tensors[p].data.shape[0] == slots[p].rows for p in parts)}


def load_gguf_weights(model, ckpt: GGUFCheckpoint, quantized: dict[str, list[str]] | None = None) -> None:
    """Load every tensor into `model`, q/k rows un-permuted (`_hf_rows`): those of `quantized` layers
    (`quantized_layers`) as their blocks, the others dequantized (converted to the model's dtype)."""
    from flock.model.loader import copy_into, hf_tensor_slots, missing_tensors
    from flock.model.quant import KERNEL_TYPES, TRANSCODED

    quantized = quantized or {}
    slots = hf_tensor_slots(model)
    names = gguf_to_hf_names(ckpt.architecture, model.config.num_hidden_layers, slots)
    in_blocks = {name for parts in quantized.values() for name in parts}
    loaded, expanded = {names[name] for name in in_blocks}, set()
    for tensor in ckpt.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue
        name = names.get(tensor.name)
        if name is None:
            raise ValueError(f"{ckpt.path.name}: unexpected tensor {tensor.name!r} for {ckpt.architecture}")
        if tensor.name in in_blocks:
            continue
        if tensor.tensor_type.name not in (*KERNEL_TYPES, *TRANSCODED, *FLOATS):
            expanded.add(tensor.tensor_type.name)
        try:
            values = dequantize(tensor)
        except NotImplementedError:
            raise ValueError(f"{ckpt.path.name}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, a "
                             "quant type the gguf package cannot dequantize") from None
        values = _hf_rows(values, tensor.name, ckpt)
        if ckpt.architecture in GEMMA and tensor.name.endswith("norm.weight"):
            values = values - 1  # back to Hugging Face's offsets from 1
        if values.ndim == 1 and slots[name].param.ndim == 2:  # Qwen2-MoE's shared expert gate, [1, hidden]
            values = values[None]
        copy_into(slots[name], torch.from_numpy(np.require(values, requirements="W")), tensor.name, ckpt.path.name)
        loaded.add(name)
    missing_tensors(slots, loaded, ckpt.path.name)
    model.use_quantized(_read_blocks(ckpt, quantized))
    for kind in sorted({t.tensor_type.name for t in ckpt.tensors if t.name in in_blocks} & set(TRANSCODED)):
        _, _, size, target = TRANSCODED[kind]
        log.info("%s: %s blocks run as the %s blocks of the same values (%.2fx their bytes)", ckpt.path.name, kind,
                 target, KERNEL_TYPES[target][2] / size)
    if expanded:
        log.info("%s: tensors of type %s are dequantized at load (Flock has no kernel for them)", ckpt.path.name,
                 ", ".join(sorted(expanded)))


def dequantize(tensor) -> np.ndarray:
    """A tensor's values as floats: by Flock's kernel, on all threads, for the types it has one for (the gguf
    package's numpy dequantizer gives the same values, several times slower), else by the gguf package."""
    from gguf import dequantize

    from flock.model import quant

    qtype = int(tensor.tensor_type)
    if qtype not in quant.BLOCK_TYPES or quant.unavailable(torch.float32, torch.device("cpu")) is not None:
        return dequantize(tensor.data, tensor.tensor_type)
    blocks = torch.from_numpy(np.require(tensor.data, requirements="W"))
    return quant.dequantize(quant.QuantWeight([quant.transcode(qtype, blocks)])).numpy()


def _hf_rows(rows: np.ndarray, name: str, ckpt: GGUFCheckpoint) -> np.ndarray:
    return hf_rows(rows, name, ckpt.architecture, ckpt.config)


def hf_rows(rows: np.ndarray, name: str, arch: str, config: dict) -> np.ndarray:
    """A tensor's rows (floats or quantized blocks) in Hugging Face's order. llama.cpp's converter reorders a
    Llama (or Granite) q or k projection's rows within each head, for a rope that rotates neighbouring dims where Hugging
    Face's rotates the two halves: each head's rows (2 i, 2 i + 1) go back to (i, i + half). Qwen2 and Qwen3 files
    keep Hugging Face's order. Done here rather than by transformers' tensor processors, whose module is slow to
    import at every start."""
    if arch not in PERMUTED_QK or not (".attn_q." in name or ".attn_k." in name):
        return rows
    heads = config["num_attention_heads"]
    if ".attn_k." in name:
        heads = config.get("num_key_value_heads", heads)
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _read_blocks(ckpt: GGUFCheckpoint, layers: dict[str, list[str]]) -> dict:
    """Each layer's quantized blocks, read from the file straight into one tensor per run of parts of one type
    (a fused gate_up is never copied, the file's mapping never touched), q/k rows un-permuted; runs the kernels
    read interleaved go through one scratch buffer, reused, so that no freed block is left behind in the heap."""
    from flock.model.quant import QuantWeight, for_kernels, interleaves, transcode

    tensors = {t.name: t for t in ckpt.tensors}
    weights, scratch = {}, torch.empty(0, dtype=torch.uint8)
    with open(ckpt.path, "rb") as f:
        for layer, names in layers.items():
            parts = []
            for qtype, run in itertools.groupby((tensors[n] for n in names), key=lambda t: int(t.tensor_type)):
                run = list(run)
                shape = (sum(t.data.shape[0] for t in run), run[0].data.shape[1])
                if interleaves(shape[0]):
                    if scratch.numel() < shape[0] * shape[1]:
                        scratch = torch.empty(0, dtype=torch.uint8)  # the smaller one freed before the next
                        scratch = torch.empty(shape[0] * shape[1], dtype=torch.uint8)
                    blocks = scratch[:shape[0] * shape[1]].view(shape)
                else:
                    blocks = torch.empty(shape, dtype=torch.uint8)
                row = 0
                for t in run:
                    rows = blocks[row:row + t.data.shape[0]].numpy()
                    f.seek(t.data_offset)
                    if f.readinto(memoryview(rows).cast("B")) != t.n_bytes:
                        raise ValueError(f"{ckpt.path.name}: tensor {t.name!r} is truncated")
                    rows[...] = _hf_rows(rows, t.name, ckpt)
                    row += len(rows)
                parts.append(for_kernels(transcode(qtype, blocks)))
            weights[layer] = QuantWeight(parts)
    return weights


def gguf_to_hf_names(arch: str, num_layers: int, hf_names) -> dict[str, str]:
    """llama.cpp's tensor names (`blk.0.attn_q.weight`) for Hugging Face ones, from the gguf package's table."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    table = get_tensor_name_map(arch_id, num_layers)
    names = {}
    for hf_name in hf_names:
        module, _, kind = hf_name.rpartition(".")
        expert = EXPERT.search(module)  # an expert's slice of the layer's 3D tensor (split_experts)
        if expert:
            module = module[: expert.start()] + ".experts" + module[expert.end() :]
        names[f"{table.get_name(module)}.{kind}" + (f"#{expert[1]}" if expert else "")] = hf_name
    return names

