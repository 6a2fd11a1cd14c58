import importlib.util

import torch

from flock.attention import cpu
from flock.attention.base import AttentionBackend, AttentionMetadata, StepLayout
from flock.attention.cascade import TorchCascadeBackend
from flock.attention.cpu import CpuCascadeBackend
from flock.attention.layered import LayeredBackend
from flock.attention.torch_paged import TorchPagedBackend
from flock.attention.triton_cascade import TritonCascadeBackend  # imports triton only when used

__all__ = ["AttentionBackend", "AttentionMetadata", "StepLayout", "BACKENDS", "make_backend"]

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchPagedBackend,
    "torch-cascade": TorchCascadeBackend,
    "triton": TritonCascadeBackend,
    "cpu": CpuCascadeBackend,
}


def make_backend(name: str, config, device, dtype, kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """`config` is a ModelConfig; `kv_dtype` the caches' elements (default: dtype; fp8, see flock.kv.fp8). "auto"
    picks the best backend available for the device; "cpu" is the fused CPU kernel, whose ISA path is chosen at
    run time (FLOCK_CPU_ISA forces one). Layers of different windows get a backend each (LayeredBackend)."""
    if name == "auto":
        # torch-cascade equals torch when no two requests share prefix blocks; Triton's kernel reads no fp8 cache
        if device.type == "cuda" and importlib.util.find_spec("triton") and kv_dtype in (None, dtype):
            name = "triton"
        elif device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and cpu.kernel_unavailable() is None:
            name = "cpu"
        else:
            name = "torch-cascade"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(sorted(BACKENDS))}")
    c = config
    backends = {window: BACKENDS[name](c.num_attention_heads, c.num_key_value_heads, c.head_dim, window, dtype,
                                       scale=c.attention_scale, softcap=c.attn_logit_softcapping, kv_dtype=kv_dtype)
                for window in dict.fromkeys(c.layer_windows)}
    return next(iter(backends.values())) if len(backends) == 1 else LayeredBackend(backends)
