"""The adapters an engine serves: each loaded once by name and given an id (1, 2, ...; 0 is the base model),
its updates placed on the model's projections; each step tells them which rows run which adapter."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flock.lora.adapter import Adapter, load_adapter, load_gguf_adapter
from flock.lora.layers import LinearLoRA, Part, ProjectionUpdate, StepAdapters
from flock.lora.request import LoRARequest
from flock.model import gemm
from flock.model.loader import text_decoder_name


@dataclass
class Target:
    """Where a Hugging Face projection lives in the model: a Linear and its output columns there."""

    lora: LinearLoRA
    in_features: int
    columns: slice


class LoRAModel:
    def __init__(self, model, max_lora_rank: int | None, dtype: torch.dtype, device: torch.device):
        self.max_lora_rank, self.dtype, self.device = max_lora_rank, dtype, device
        self.step = StepAdapters()
        c = model.config
        self.model_type = c.model_type
        self.heads = {"num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads}
        model.unfuse_glu()  # an update of gate or up must land before the activation
        model.lora_step = self.step
        # bf16 updates on Flock's GEMM where it runs (whatever the base weights' path: packed, oneDNN, quantized)
        packed = gemm.unavailable(dtype, device) is None
        self.targets = _targets(model, self.step, packed)
        self.loaded: dict[str, tuple[LoRARequest, int]] = {}  # name -> (its request, its id)
        self._next_id = 1

    def add(self, request: LoRARequest) -> int:
        """The id of the request's adapter, loaded from its folder (or GGUF file) the first time its name is seen."""
        request.validate()
        if request.lora_name in self.loaded:
            known, adapter_id = self.loaded[request.lora_name]
            if known.lora_path != request.lora_path:
                raise ValueError(f"LoRA adapter {request.lora_name!r} is loaded from {known.lora_path}, not "
                                 f"{request.lora_path}")
            return adapter_id
        if Path(request.lora_path).is_file():  # llama.cpp's: one GGUF file
            adapter = load_gguf_adapter(request.lora_name, request.lora_path, self.model_type, self.heads,
                                        sorted(self.targets))
        else:
            adapter = load_adapter(request.lora_name, request.lora_path)
        if self.max_lora_rank is not None and adapter.rank > self.max_lora_rank:
            raise ValueError(f"LoRA adapter {request.lora_name!r} has rank {adapter.rank}, more than max_lora_rank="
                             f"{self.max_lora_rank}")
        updates = self._projection_updates(adapter)
        adapter_id, self._next_id = self._next_id, self._next_id + 1
        for lora, update in updates:
            lora.updates[adapter_id] = update
        self.loaded[request.lora_name] = (request, adapter_id)
        return adapter_id

    def remove(self, name: str) -> None:
        """Forget an adapter (its requests must have finished)."""
        _, adapter_id = self.loaded.pop(name)
        for target in self.targets.values():
            target.lora.forget(adapter_id)

    def id_of(self, request: LoRARequest | None) -> int:
        return 0 if request is None else self.loaded[request.lora_name][1]

    def set_step(self, adapter_ids: list[int], counts: np.ndarray, out_rows: list[int] | None) -> None:
        """The step's requests' adapter ids and token counts, and the rows its last layer finishes."""
        if any(adapter_ids):
            self.step.set(np.repeat(np.array(adapter_ids), counts), out_rows, self.device)
        else:
            self.step.clear()

    def _projection_updates(self, adapter: Adapter) -> list[tuple[LinearLoRA, ProjectionUpdate]]:
        by_projection: dict[int, tuple[LinearLoRA, list]] = {}
        for module, update in adapter.updates.items():
            name = _hf_name(module)
            target = self.targets.get(name)
            if target is None:
                raise ValueError(f"LoRA adapter {adapter.name!r} ({adapter.path}) updates {module}, which Flock does "
                                 "not run adapters on (it runs them on the attention and dense MLP projections)")
            cols = target.columns.stop - target.columns.start
            if update.a.shape[1] != target.in_features or update.b.shape[0] != cols:
                raise ValueError(f"LoRA adapter {adapter.name!r}: {module} has lora_A {tuple(update.a.shape)} and "
                                 f"lora_B {tuple(update.b.shape)}; this model needs [r, {target.in_features}] and "
                                 f"[{cols}, r] (an adapter of another model?)")
            by_projection.setdefault(id(target.lora), (target.lora, []))[1].append((target.columns, update))
        out = []
        for lora, parts in by_projection.values():
            ranks = np.cumsum([0] + [u.a.shape[0] for _, u in parts]).tolist()
            a = torch.cat([u.a for _, u in parts]).to(self.dtype).to(self.device)
            out.append((lora, ProjectionUpdate(a, [Part(cols, slice(lo, hi), u.b.to(self.dtype).to(self.device))
                                                   for (cols, u), lo, hi in zip(parts, ranks, ranks[1:])])))
        return out


def _hf_name(module: str) -> str:
    """An adapter's module name as a text-only checkpoint names it ("model.layers.0.self_attn.q_proj")."""
    name = text_decoder_name(module) or module
    return f"model.{name}" if name.startswith("layers.") else name


def _targets(model, step: StepAdapters, packed: bool) -> dict[str, Target]:
    """Every projection an adapter may update, by its Hugging Face module name (fused ones by their parts too)."""
    targets = {}
    for i, layer in enumerate(model.layers):
        attn, mlp, at = layer.self_attn, layer.mlp, f"model.layers.{i}"
        parts = {"self_attn.qkv_proj": (attn.qkv_proj, {"q_proj": attn.q_size, "k_proj": attn.kv_size,
                                                        "v_proj": attn.kv_size}),
                 "self_attn.o_proj": (attn.o_proj, {})}
        if hasattr(mlp, "gate_up_proj"):  # a dense MLP; a mixture's experts take no adapter
            width = mlp.down_proj.in_features
            parts |= {"mlp.gate_up_proj": (mlp.gate_up_proj, {"gate_proj": width, "up_proj": width}),
                      "mlp.down_proj": (mlp.down_proj, {})}
        for name, (linear, pieces) in parts.items():
            linear.lora = LinearLoRA(step, packed and gemm.takes(linear.in_features))
            targets[f"{at}.{name}"] = Target(linear.lora, linear.in_features, slice(0, linear.out_features))
            start, prefix = 0, f"{at}.{name.split('.')[0]}"
            for piece, width in pieces.items():
                targets[f"{prefix}.{piece}"] = Target(linear.lora, linear.in_features, slice(start, start + width))
                start += width
    return targets
