import importlib.util

import torch

from flock.attention.amx import AmxCascadeBackend, kernel_unavailable
from flock.attention.base import AttentionBackend, AttentionMetadata, StepLayout
from flock.attention.cascade import TorchCascadeBackend
from flock.attention.torch_paged import TorchPagedBackend
from flock.attention.triton_cascade import TritonCascadeBackend  # imports triton only when used

__all__ = ["AttentionBackend", "AttentionMetadata", "StepLayout", "BACKENDS", "make_backend"]

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchPagedBackend,
    "torch-cascade": TorchCascadeBackend,
    "triton": TritonCascadeBackend,
    "amx": AmxCascadeBackend,
}


def make_backend(name: str, config, device, dtype) -> AttentionBackend:
    """`config` is a ModelConfig. "auto" picks the best backend available for the device."""
    if name == "auto":
        # torch-cascade equals torch when no two requests share prefix blocks; the AMX kernel takes bf16 on CPUs
        if device.type == "cuda" and importlib.util.find_spec("triton"):
            name = "triton"
        elif device.type == "cpu" and dtype == torch.bfloat16 and kernel_unavailable() is None:
            name = "amx"
        else:
            name = "torch-cascade"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(sorted(BACKENDS))}")
    c = config
    return BACKENDS[name](c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window, dtype)
