"""Models whose layers attend over different ranges (Gemma 2's and 3's sliding-window and global layers, Qwen2's
`max_window_layers`): a backend for each window, each planning every step for its own layers. A windowed plan
keeps its requests past the window out of prefix groups; the global layers' plan still shares their prefixes."""

from dataclasses import dataclass, field

from flock.attention.base import AttentionBackend, AttentionMetadata, StepLayout


@dataclass
class LayeredMetadata(AttentionMetadata):
    parts: dict[int | None, AttentionMetadata] = field(default_factory=dict)  # window -> its layers' plan

    def for_window(self, window: int | None) -> AttentionMetadata:
        return self.parts[window]


class LayeredBackend(AttentionBackend):
    def __init__(self, backends: dict[int | None, AttentionBackend]):
        self.backends = backends
        first = next(iter(backends.values()))
        self.name, self.isa = first.name, getattr(first, "isa", None)

    def for_window(self, window: int | None) -> AttentionBackend:
        return self.backends[window]

    def build_metadata(self, layout: StepLayout) -> LayeredMetadata:
        parts = {window: b.build_metadata(layout) for window, b in self.backends.items()}
        meta = LayeredMetadata(layout.slot_mapping, parts)
        if all(p.rows_only is not None for p in parts.values()):
            meta.rows_only = LayeredMetadata(layout.slot_mapping, {w: p.rows_only for w, p in parts.items()})
        return meta

    def uses_kernel(self, device) -> bool:
        return all(getattr(b, "uses_kernel", lambda d: False)(device) for b in self.backends.values())

    def forward(self, q, k, v, k_cache, v_cache, meta):
        raise TypeError("a layered backend attends through the backend of each layer's window (for_window)")
