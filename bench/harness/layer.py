"""One attention layer outside a model, for the attention benchmarks: a backend by name (a forced ISA path of
the fused CPU kernel included), the fused paths this CPU runs, and a cache flush between timed calls."""

import torch

from flock.attention import cpu, make_backend
from flock.model.config import ModelConfig

__all__ = ["DTYPES", "Flusher", "model_config", "fused_paths", "make", "ms"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Flusher:
    """Reads a buffer larger than the last-level cache, so the next call finds its data in memory."""

    def __init__(self, mib: int):
        self.buf = torch.ones(mib * 2**20 // 4) if mib > 0 else None

    def __call__(self):
        if self.buf is not None:
            self.buf.sum()


def model_config(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    """A one-layer Llama config of this head shape (the rest does not matter to attention)."""
    return ModelConfig("llama", 32000, heads * head_dim, 4 * heads * head_dim, 1, heads, kv_heads, head_dim)


def fused_paths(dtype: torch.dtype) -> list[str]:
    """The fused kernel's ISA paths this CPU runs, best first."""
    return [f"cpu-{isa}" for isa in cpu.isa_paths()] if cpu.kernel_unavailable() is None else []


def make(name: str, cfg: ModelConfig, dtype: torch.dtype):
    """A backend by name; "cpu-<isa>" is the cpu kernel forced onto that ISA path."""
    if name.startswith("cpu-"):
        isa = name.removeprefix("cpu-")
        if why := cpu.kernel_unavailable(isa):  # else it would time torch-cascade under the kernel's name
            raise SystemExit(f"{name}: {why}")
        c = cfg
        return cpu.CpuCascadeBackend(c.num_attention_heads, c.num_key_value_heads, c.head_dim, None, dtype, isa=isa)
    return make_backend(name, cfg, torch.device("cpu"), dtype)


def ms(seconds: float) -> str:
    """Milliseconds with three significant digits or so."""
    x = seconds
    return f"{x * 1e3:.3f}" if x < 0.01 else f"{x * 1e3:.2f}" if x < 0.1 else f"{x * 1e3:.1f}"
