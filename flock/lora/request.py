import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: run a request with the LoRA adapter saved by PEFT in the folder `lora_path` (or a llama.cpp GGUF
    file), known by `lora_name` (the API's model name for it). An engine loads a name's folder once; the int id is
    vLLM's and not used. `load_inplace`: `LLMEngine.load_lora` reads it again (requests use what is loaded);
    `base_model_name` and `is_3d_lora_weight` (MoE experts' layout; Flock runs no expert adapters) are vLLM's,
    kept for its scripts."""

    lora_name: str
    lora_int_id: int = 1
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False

    def validate(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request {self.lora_name!r}: lora_path must name a PEFT adapter folder")


def lora_requests(modules: list[str]) -> dict[str, LoRARequest]:
    """The adapters of `--lora-modules`, by name: each NAME=PATH, or vLLM's JSON {"name": ..., "path": ...}."""
    out = {}
    for i, spec in enumerate(modules):
        if spec.lstrip().startswith("{"):
            try:
                value = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"lora_modules[{i}]: not JSON: {e}") from None
            name, path = (value.get(k) if isinstance(value, dict) else None for k in ("name", "path"))
        else:
            name, _, path = spec.partition("=")
        request = LoRARequest(name, i + 1, path)
        try:
            request.validate()
        except ValueError as e:
            raise ValueError(f"lora_modules[{i}] {spec!r}: give NAME=PATH or {{\"name\": ..., \"path\": ...}} "
                             f"({e})") from None
        if name in out:
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        out[name] = request
    return out
