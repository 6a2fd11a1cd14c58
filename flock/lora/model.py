"""The adapters an engine serves: each loaded once per name and folder and given an id (1, 2, ...; 0 is the base
model), its updates placed on the model's projections; each step tells them which rows run which adapter. An
adapter unloaded (or loaded again in place) keeps its weights until the requests admitted with it finish."""

import os
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
        self.loaded: dict[tuple[str, str], int] = {}  # (name, folder) -> id of the adapters kept loaded
        # unloaded or replaced: requests still carrying one (admitted late) run on a copy read for them, which goes
        # with their last
        self.retired: set[tuple[str, str]] = set()
        self.copies: dict[tuple[str, str], int] = {}  # a retired key -> its copy's id
        self.users: dict[int, set[int]] = {}  # adapter id -> the engine ids of its unfinished requests
        self.released: set[int] = set()  # ids out of `loaded`, forgotten when their last request finishes
        self._next_id = 1

    @staticmethod
    def key(request: LoRARequest) -> tuple[str, str]:
        return request.lora_name, request.lora_path

    def check(self, request: LoRARequest) -> None:
        """ValueError naming what is wrong with the request's adapter, loaded now (and kept) if it is new."""
        request.validate()
        if self.key(request) not in self.loaded and self.key(request) not in self.retired:
            self.load(request)

    def load(self, request: LoRARequest, inplace: bool = False) -> int:
        """Load the request's adapter from its folder (or GGUF file), once; `inplace`: read it again, its name's
        earlier loads retired."""
        request.validate()
        key = self.key(request)
        if key in self.loaded and not inplace:
            return self.loaded[key]
        adapter_id = self._read(request)
        for known in [k for k in self.loaded if inplace and k[0] == request.lora_name]:
            self._retire(known)
        self.loaded[key] = adapter_id
        self.retired.discard(key)
        self.copies.pop(key, None)  # (a copy in use stays until its requests finish)
        return adapter_id

    def unload(self, name: str) -> None:
        """Retire every load of `name` (ValueError if none)."""
        keys = [k for k in self.loaded if k[0] == name]
        if not keys:
            raise ValueError(f"no LoRA adapter is loaded as {name!r}")
        for key in keys:
            self._retire(key)

    def admit(self, request: LoRARequest | None, request_id: int) -> int:
        """The adapter id a new engine request runs with (0: none), counted as in use until `finished`."""
        if request is None:
            return 0
        key = self.key(request)
        if key in self.loaded:
            adapter_id = self.loaded[key]
        elif key in self.retired:
            if key not in self.copies:
                self.copies[key] = self._read(request)
                self.released.add(self.copies[key])
            adapter_id = self.copies[key]
        else:
            adapter_id = self.load(request)
        self.users.setdefault(adapter_id, set()).add(request_id)
        return adapter_id

    def finished(self, adapter_id: int, request_id: int) -> None:
        users = self.users.get(adapter_id)
        if users is None:
            return
        users.discard(request_id)
        if not users:
            del self.users[adapter_id]
            if adapter_id in self.released:
                self._forget(adapter_id)

    def _retire(self, key: tuple[str, str]) -> None:
        adapter_id = self.loaded.pop(key)
        self.retired.add(key)
        if adapter_id in self.users:
            self.released.add(adapter_id)
        else:
            self._forget(adapter_id)

    def _forget(self, adapter_id: int) -> None:
        self.released.discard(adapter_id)
        self.copies = {k: i for k, i in self.copies.items() if i != adapter_id}
        for target in self.targets.values():
            target.lora.forget(adapter_id)

    def _read(self, request: LoRARequest) -> int:
        """Read an adapter and place its updates under a new id."""
        path = os.path.expanduser(request.lora_path)
        if Path(path).is_file():  # llama.cpp's: one GGUF file
            adapter = load_gguf_adapter(request.lora_name, path, self.model_type, self.heads, sorted(self.targets))
        else:
            adapter = load_adapter(request.lora_name, path)
        if self.max_lora_rank is not None and adapter.rank > self.max_lora_rank:
            raise ValueError(f"LoRA adapter {request.lora_name!r} has rank {adapter.rank}, more than max_lora_rank="
                             f"{self.max_lora_rank}")
        updates = self._projection_updates(adapter)
        adapter_id, self._next_id = self._next_id, self._next_id + 1
        for lora, update in updates:
            lora.updates[adapter_id] = update
        return adapter_id

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
