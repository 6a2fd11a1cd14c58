from flock.attention.base import AttentionBackend, AttentionMetadata, StepLayout
from flock.attention.cascade import TorchCascadeBackend
from flock.attention.torch_paged import TorchPagedBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchPagedBackend, "torch-cascade": TorchCascadeBackend}


def make_backend(name: str, config, device, dtype) -> AttentionBackend:
    """`config` is a ModelConfig. "auto" picks the best backend available for the device."""
    if name == "auto":
        name = "torch-cascade"  # equals "torch" when no two requests share prefix blocks
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name](config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.sliding_window, dtype)
