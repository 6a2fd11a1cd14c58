"""LoRA adapters (PEFT folders, llama.cpp GGUF files) served beside a model's own weights: see
docs/architecture.md#lora-adapters."""

from flock.lora.request import LoRARequest, lora_requests

__all__ = ["LoRARequest", "lora_requests"]
