"""What the quantized-GGUF benchmarks ask of a Flock engine: the `quantization` engine field where this Flock
has it, the engine's kernel paths (the quantized GEMM's included) and its resident memory."""

from dataclasses import fields
from pathlib import Path

import torch

from bench.harness import machine

__all__ = ["has_quantization_field", "engine_kwargs", "rss_bytes", "quant_path", "engine_paths"]


def has_quantization_field() -> bool:
    from flock.config import EngineConfig

    return "quantization" in {f.name for f in fields(EngineConfig)}


def engine_kwargs(mode: str) -> dict:
    """quantized: the file's blocks kept ("gguf"; "auto" dequantizes small models on AMX CPUs); none: dequantized
    at load. Before EngineConfig has the field, both run without it (today's dequantizing engine), and the
    header says so."""
    if not has_quantization_field():
        return {}
    from flock.config import QUANTIZATION

    if mode == "none":
        return {"quantization": "none"}
    return {"quantization": "gguf"} if "gguf" in QUANTIZATION else {}


def rss_bytes() -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def quant_path() -> str:
    """The ISA path of Flock's quantized GEMM here (flock.model.quant), or why there is none."""
    try:
        from flock.model import quant
    except ImportError:
        return "none (this Flock has no flock.model.quant)"
    why = quant.unavailable(torch.float32, torch.device("cpu"))
    return f"{quant.isa()}" if why is None else f"unavailable ({why})"


def engine_paths(llm, model: str) -> dict:
    """The engine's dtype and kernel paths: attention (as an engine of that dtype picks it), then the runner's own
    record (elementwise, GEMMs, and the quantized GEMM with the layers it serves)."""
    dtype = llm.engine.runner.dtype
    paths = {"attention": machine.attention_path("auto", model, dtype), **llm.engine.runner.paths}
    return {"dtype": str(dtype), "paths": paths}
