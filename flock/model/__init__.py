"""Model building: resolve a name to a Hugging Face folder or a GGUF file, build the decoder, load or draw its
weights."""

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from flock import native
from flock.attention.base import AttentionBackend
from flock.model import fused_ops, gemm, gguf_table, hf_quant, linear, quant
from flock.model.builtin import BUILTIN_MODELS, WHEEL_MODELS, is_builtin, materialize
from flock.model.config import ModelConfig
from flock.model.gguf import (
    GGUFCheckpoint,
    find_gguf,
    load_gguf_weights,
    quantized_layers,
    read_gguf,
    split_as_llama_cpp,
)
from flock.model.llama import LlamaForCausalLM
from flock.model.loader import init_dummy, load_safetensors, save_safetensors

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,  # vLLM's
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "float16": torch.float16,
    "half": torch.float16,
}

log = logging.getLogger("flock")


@dataclass
class ResolvedModel:
    folder: Path
    config: ModelConfig
    builtin: bool  # random weights unless told otherwise
    gguf: GGUFCheckpoint | None = None

    @property
    def tokenizer_path(self) -> Path:
        return self.gguf.path if self.gguf else self.folder


def locate_model(name: str) -> Path:
    """The Hugging Face folder or GGUF file a model name stands for: a built-in name, a folder, a GGUF file or a
    folder holding one GGUF."""
    if is_builtin(name):
        return materialize(name)
    path = WHEEL_MODELS[name].path(name) if name in WHEEL_MODELS else Path(name)
    if not path.exists():
        raise FileNotFoundError(f"model {name!r} is not a local folder, a GGUF file or a built-in model "
                                f"({', '.join([*BUILTIN_MODELS, *WHEEL_MODELS])})")
    return find_gguf(path) or path


def load_gguf_tokenizer(gguf_file: Path):
    """The tokenizer inside a GGUF file as transformers converts it: BPE or SentencePiece vocabulary, special
    tokens, chat template. Never the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import PreTrainedTokenizerFast

    gguf_file = gguf_file.resolve()
    kept, tokenizer = gguf_table.tokenizer_folder(gguf_file), None
    if (kept / "tokenizer.json").is_file():
        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(kept), local_files_only=True)
        except Exception:  # tokenizers raises its own kinds: a damaged copy, converted again
            shutil.rmtree(kept, ignore_errors=True)
    if tokenizer is None:
        # the fast class itself: AutoTokenizer would first read the whole file again for its config; from an empty
        # folder, since transformers prefers a tokenizer.json beside the file to the one inside it
        with tempfile.TemporaryDirectory() as nothing:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(nothing, gguf_file=str(gguf_file),
                                                                local_files_only=True)
        split_as_llama_cpp(tokenizer, gguf_file)
        gguf_table.keep_tokenizer(tokenizer, kept)
    tokenizer.name_or_path = str(gguf_file)  # loading it again by this name finds the same file
    return tokenizer


def resolve_model(name: str, hf_overrides: dict | None = None) -> ResolvedModel:
    """The model `name` finds; `hf_overrides` replace its config's keys (EngineConfig.hf_overrides)."""
    path = locate_model(name)
    if is_builtin(name):
        return ResolvedModel(path, ModelConfig.from_folder(path, hf_overrides), True)
    if path.is_file():
        ckpt = read_gguf(path)
        return ResolvedModel(path.parent, ModelConfig.from_dict({**ckpt.config, **(hf_overrides or {})}), False, ckpt)
    return ResolvedModel(path, ModelConfig.from_folder(path, hf_overrides), False)


FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # a CPU without either runs bf16 matmuls slower than float32


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype a model runs in. "auto" takes the model's own, except that a bf16 or f16 model runs in float32
    on a CPU with no bf16 dot products (AVX2-only CPUs): widening is exact, and float32 GEMMs are faster there.
    float16 runs as bfloat16 on a CPU (its matmuls are very slow there), said in the log."""
    asked = name
    if name == "auto":
        name = config.torch_dtype or "float32"
        if device.type == "cpu" and name in ("bfloat16", "float16") and not native.cpu_flags() & set(FAST_BF16_FLAGS):
            log.info("this CPU has no %s: the %s model runs in float32", " or ".join(FAST_BF16_FLAGS), name)
            name = "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported (choose from auto, {', '.join(DTYPES)})")
    dtype = DTYPES[name]
    if dtype is torch.float16 and device.type == "cpu":
        (log.info if asked == "auto" else log.warning)(
            "float16 runs as bfloat16 on a CPU (float16 matmuls are very slow there); dtype float32 keeps every bit")
        return torch.bfloat16
    return dtype


def build_model(
    resolved: ResolvedModel,
    backend: AttentionBackend,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    seed: int,
    quantization: str = "none",
    classifier_ids: Sequence[int] = (),
) -> LlamaForCausalLM:
    """The model with its weights; `quantization` as EngineConfig.quantization says; a causal LM made a
    classifier takes its score rows from the LM head's rows of `classifier_ids` (see classifier_token_ids)."""
    if resolved.config.encoder:
        raise ValueError(f"{resolved.folder} is a bidirectional encoder ({resolved.config.model_type}): it embeds and "
                         "classifies as an engine's model, it is no decoder")
    if load_format == "auto":
        load_format = "dummy" if resolved.builtin else "gguf" if resolved.gguf else "safetensors"
    allowed = ("dummy", "gguf" if resolved.gguf else "safetensors")
    if load_format not in allowed:
        raise ValueError(f"load_format {load_format!r} is not supported for {resolved.tokenizer_path} "
                         f"(auto, {', '.join(allowed)})")
    scheme = checkpoint_scheme(resolved, load_format, quantization)
    why = quant.unavailable(dtype, device) if quantization != "none" else None
    if why and quantization != "auto":
        raise ValueError(f"quantization={quantization!r}: {why}")
    with torch.device("meta"):
        model = LlamaForCausalLM(resolved.config, backend)
    quantized = load_format == "gguf" or scheme is not None
    if quantization == "auto" and not why and quantized:
        why = quant.blocks_lose(dtype, sum(p.numel() for p in model.parameters()) * dtype.itemsize)
    in_blocks = {}
    if quantized and quantization != "none" and not why:
        in_blocks = (quantized_layers(model, resolved.gguf) if load_format == "gguf"
                     else hf_quant.quantized_layers(model, resolved.folder, scheme))
    for name in in_blocks:  # never allocated as floats
        model.get_submodule(name).weight.data = torch.empty(0, device="meta")
    if why and quantized:
        log.info("%s: the weights are dequantized (%s)", resolved.tokenizer_path.name, why)
    model.to(dtype)  # on the meta device: the weights are then allocated once, in their dtype
    allocate(model, device)
    model.finish_init(max_positions, dtype, device)
    with torch.no_grad():
        if load_format == "dummy":
            init_dummy(model, seed)
        elif load_format == "gguf":
            load_gguf_weights(model, resolved.gguf, in_blocks)
        else:
            load_safetensors(model, resolved.folder, scheme, in_blocks)
        if resolved.config.classifier_tokens:
            model.score_from_tokens(list(classifier_ids))
        if quantization in quant.LOAD_TYPES:
            quantize_float_layers(model, quantization)
    return model.eval()


def classifier_token_ids(tokenizer, config: ModelConfig) -> list[int]:
    """The vocabulary ids of a causal LM classifier's tokens (ModelConfig.classifier_tokens), as vLLM finds them."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in config.classifier_tokens]
    for token, i in zip(config.classifier_tokens, ids):
        if i is None or (i == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(f"classifier_from_token {token!r} is not a token of the vocabulary")
    return ids


def checkpoint_scheme(resolved: ResolvedModel, load_format: str, quantization: str) -> "hf_quant.Scheme | None":
    """The packing of a Hugging Face folder's integer weights (None: floats, a GGUF file or random weights); a
    quantization method named in `quantization` must be the checkpoint's."""
    config = resolved.config.quantization if load_format == "safetensors" else None
    scheme = hf_quant.scheme_of(config) if config else None
    found = "gguf" if load_format == "gguf" else scheme.method if scheme else None
    if quantization in ("gguf", *hf_quant.METHODS) and quantization != found:
        raise ValueError(f"quantization={quantization!r}, but {resolved.tokenizer_path} holds "
                         + (f"{found} weights" if found else "no quantized weights"))
    return scheme


def allocate(model: torch.nn.Module, device: torch.device) -> None:
    """model.to_empty(device=device) without torch's reference empty_like, whose first call on a meta tensor
    imports sympy, a slow start for every engine."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                     requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))


def quantize_float_layers(model: LlamaForCausalLM, kind: str) -> None:
    """Quantize the projections and the embedding still in floats (of a width the blocks divide) to `kind`."""
    from flock.model.linear import Embedding, Linear

    tied = model.config.tie_word_embeddings
    model.use_quantized({name: quant.QuantWeight([quant.for_kernels(quant.quantize(m.weight, kind))])
                         for name, m in model.named_modules()
                         if isinstance(m, (Linear, Embedding)) and m.qweight is None and m.weight.shape[-1] % 32 == 0
                         and not (tied and name == "lm_head")})


def apply_ops(model: LlamaForCausalLM, ops: str, dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    """Switch a loaded model to the fused elementwise kernels and prepacked GEMM weights as `ops` asks
    (EngineConfig.ops: "auto" takes each where it can run). Returns the path each part runs on."""
    paths = {"elementwise": "PyTorch ops", "gemm": "F.linear"}
    if types := model.quantized_types():
        layers = ", ".join(f"{n} {t}" for t, n in sorted(types.items()))
        paths["quantized"] = f"int8 GEMM on GGUF blocks ({quant.isa()}): {layers}"
    if ops in ("auto", "fused"):
        why = fused_ops.unavailable(dtype, device)
        if why is None:
            model.use_fused_ops()
            paths["elementwise"] = f"fused C kernels ({fused_ops.isa()})"
        elif ops == "fused":
            raise ValueError(f"ops='fused': {why}")
        else:
            paths["elementwise"] += f" ({why})"
    pairs = ops in ("auto", "packed") and gemm.unavailable(dtype, device) is None
    if ops in ("auto", "packed"):
        why = linear.unavailable(dtype, device)
        if pairs:
            model.prepack_weights(pairs=True)
            paths["gemm"] = f"Flock bf16 GEMM ({gemm.isa()}), packed weights, SiLU-and-mul in its gate_up GEMM"
        elif why is None:
            model.prepack_weights()
            paths["gemm"] = "oneDNN, prepacked weights"
        elif ops == "packed":
            raise ValueError(f"ops='packed': {why}")
        else:
            paths["gemm"] += f" ({why})"
    if ops in ("auto", "fused") and (types or pairs):
        why = model.use_step_program()
        paths["step"] = ("a step's layers in one C call (a prefill's last in Python)" if why is None
                         else f"Python between the kernels ({why})")
    return paths


def save_model(name: str, out_dir: str | Path, dtype: str = "auto", seed: int = 0) -> Path:
    """Save a model (built-in, folder or GGUF; dummy weights for flock/tiny and the bench models) as a plain
    Hugging Face folder."""
    from flock.attention.torch_paged import TorchPagedBackend

    resolved = resolve_model(name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = resolved.config
    torch_dtype = resolve_dtype(dtype, c, torch.device("cpu"))
    backend = TorchPagedBackend(c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window, torch_dtype)
    model = build_model(resolved, backend, "auto", torch_dtype, torch.device("cpu"), 1, seed)
    save_safetensors(model, out)
    gguf = resolved.gguf
    config = dict(gguf.config) if gguf else json.loads((resolved.folder / "config.json").read_text())
    config["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    for key in ("quantization_config", "compression_config"):  # the weights are written dequantized
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if gguf:
        load_gguf_tokenizer(gguf.path).save_pretrained(out)
        return out
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (resolved.folder / f).exists() and resolved.folder.resolve() != out.resolve():
            shutil.copy(resolved.folder / f, out / f)
    return out
