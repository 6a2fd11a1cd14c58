from dataclasses import dataclass, field
import json
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        eos = d.get("eos_token_id")
        use_window = d.get("use_sliding_window", model_type == "mistral")
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
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", model_type == "qwen2"),
            o_proj_bias=model_type != "qwen2" and d.get("attention_bias", False),
            sliding_window=d.get("sliding_window") if use_window else None,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model folder)")
        return cls.from_dict(json.loads(config_file.read_text()))
