from dataclasses import dataclass, field
import json
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite")
SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN names of the one activation Flock runs
# transformers' class defaults for keys a config.json may omit
DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768, "phi3": 4096,
                         "granite": 2048}
MISTRAL_DEFAULT_WINDOW = 4096
# the generation_config.json fields vLLM turns into requests' default sampling (max_new_tokens as max_tokens)
SAMPLING_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                   "min_p", "max_new_tokens")


@dataclass
class ModelConfig:
    """The architecture facts Flock needs, read from a Hugging Face `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k before the rotary embedding
    base_model: bool = False  # the decoder without an LM head (architectures "Qwen3Model", ...): embeddings only
    # Granite's scales: of the embeddings, of each layer's attention and MLP outputs before the residual add, the
    # logits' divisor, and q k^T's (None: head_dim ** -0.5)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_scale: float | None = None
    sliding_window: int | None = None
    torch_dtype: str | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = cls._rope_scaling(dict(scaling), d, model_type)
        if (d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError("partial_rotary_factor < 1 is not supported (Flock rotates whole heads)")
        eos = d.get("eos_token_id")
        act = d.get("hidden_act", "silu")
        if act not in SILU_NAMES:
            raise ValueError(f"hidden_act {act!r} is not supported (Flock runs SiLU: {', '.join(SILU_NAMES)})")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported (Flock's MLP projections have no bias)")
        window = cls._sliding_window(d, model_type)
        architecture = (d.get("architectures") or ["ForCausalLM"])[0]
        base_model = architecture.endswith("Model") and not architecture.endswith("ForCausalLM")
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling if scaling and scaling["rope_type"] != "default" else None,
            max_position_embeddings=d.get("max_position_embeddings", DEFAULT_MAX_POSITIONS[model_type]),
            tie_word_embeddings=d.get("tie_word_embeddings", False) or base_model,  # a head-less model's unused head
            attention_bias=model_type == "qwen2" or d.get("attention_bias", False),  # Qwen2: qkv bias always
            o_proj_bias=model_type != "qwen2" and d.get("attention_bias", False),
            qk_norm=model_type == "qwen3",
            base_model=base_model,
            **cls._granite_scales(d, model_type),
            sliding_window=window,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    @staticmethod
    def _granite_scales(d: dict, model_type: str) -> dict:
        """Granite's multipliers, with transformers' GraniteConfig defaults (1.0 each, q k^T's too)."""
        if model_type != "granite":
            return {}
        return {"embedding_multiplier": d.get("embedding_multiplier", 1.0),
                "residual_multiplier": d.get("residual_multiplier", 1.0),
                "logits_scaling": d.get("logits_scaling", 1.0),
                "attention_scale": d.get("attention_multiplier", 1.0)}

    @staticmethod
    def _rope_scaling(scaling: dict, d: dict, model_type: str) -> dict:
        """rope_scaling with its rope_type named; LongRoPE's (Phi-3's "su" too) with the lengths it needs."""
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "su":
            scaling["rope_type"] = "longrope"
        if scaling["rope_type"] == "longrope":
            original = scaling.get("original_max_position_embeddings") or d["original_max_position_embeddings"]
            positions = d.get("max_position_embeddings", DEFAULT_MAX_POSITIONS[model_type])
            scaling |= {"original_max_position_embeddings": original,
                        "factor": scaling.get("factor") or positions / original}
        return scaling

    @staticmethod
    def _sliding_window(d: dict, model_type: str) -> int | None:
        """The window every layer uses, as transformers reads it: Mistral's on every layer (4096 when the key is
        absent), Phi-3's on every layer when set; Qwen2's and Qwen3's only on the layers `layer_types` marks (from
        `max_window_layers`, default 28). Flock has one window for all layers, so a mix is an error rather than a
        silently wrong model."""
        if model_type == "mistral":
            return d.get("sliding_window", MISTRAL_DEFAULT_WINDOW)
        if model_type == "phi3":  # on every layer when set, as Mistral's
            return d.get("sliding_window")
        if model_type in ("llama", "granite") or not d.get("use_sliding_window", False) or d.get("sliding_window") is None:
            return None
        layers = d["num_hidden_layers"]
        types = d.get("layer_types") or ["sliding_attention" if i >= d.get("max_window_layers", 28) else
                                         "full_attention" for i in range(layers)]
        if all(t == "full_attention" for t in types):
            return None
        if all(t == "sliding_attention" for t in types):
            return d["sliding_window"]
        raise ValueError(f"layer_types {types} mixes full and sliding-window attention (max_window_layers="
                         f"{d.get('max_window_layers', 28)}); Flock runs one attention kind for every layer")

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model folder)")
        config = cls.from_dict(json.loads(config_file.read_text()))
        generation = Path(path) / "generation_config.json"
        if generation.exists():  # transformers' generate (and vLLM) also stop at generation_config's eos ids
            eos = json.loads(generation.read_text()).get("eos_token_id")
            extra = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
            config.eos_token_id += [e for e in extra if e not in config.eos_token_id]
        return config


def sampling_defaults(folder: str | Path | None) -> dict:
    """The sampling fields a folder's generation_config.json sets, named as requests name them: the defaults vLLM's
    `--generation-config auto` gives requests that leave them unset (transformers 5 has no defaults of its own for
    them, so every field the file sets counts). Empty without a file."""
    path = Path(folder) / "generation_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    out = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out
