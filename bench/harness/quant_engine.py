"""What the quantized-GGUF benchmarks ask of a Flock engine: the `quantization` engine field where this Flock
has it, the engine's kernel paths (the quantized GEMM's included) and its resident memory."""

from dataclasses import fields
from pathlib import Path

from bench.harness import machine

__all__ = ["has_quantization_field", "engine_kwargs", "rss_bytes", "quant_path", "engine_paths"]


def has_quantization_field() -> bool:
    from flock.config import EngineConfig

    return "quantization" in {f.name for f in fields(EngineConfig)}


def engine_kwargs(mode: str) -> dict:
    """quantized: the default ("auto"); none: dequantized at load. Before EngineConfig has the field, both run
    without it (today's dequantizing engine), and the header says so."""
    if mode == "none" and has_quantization_field():
        return {"quantization": "none"}
    return {}


def rss_bytes() -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def quant_path() -> str | None:
    """The quantized GEMM path `flock.model.quant` reports, where the module has such a function."""
    try:
        import flock.model.quant as quant
    except ImportError:
        return None
    for name in ("kernel_path", "path", "chosen_path", "chosen_isa", "isa"):
        if callable(fn := getattr(quant, name, None)):
            try:
                return str(fn())
            except TypeError:
                continue
    return None


def engine_paths(llm, model: str) -> dict:
    """The engine's dtype and kernel paths: attention (as an engine of that dtype picks it), elementwise, GEMMs
    (the runner's own record; the quantized GEMM shows there), and flock.model.quant's path where it has one."""
    dtype = llm.engine.runner.dtype
    paths = {"attention": machine.attention_path("auto", model, dtype), **llm.engine.runner.paths}
    if (quant := quant_path()) is not None:
        paths["flock.model.quant"] = quant
    return {"dtype": str(dtype), "paths": paths}
