"""ModernBERT (ModernBertModel, ModernBertForSequenceClassification): a pre-norm encoder with rotary positions,
a GeGLU MLP and no biases by default, whose layers alternate one global (every `global_attn_every_n_layers`-th)
with local ones that see `local_attention / 2` positions on either side, each kind rotating by its own base."""

from dataclasses import replace

import torch
from torch import nn

from flock.attention.base import AttentionBackend
from flock.model import fused_ops
from flock.model.config import ModelConfig
from flock.model.encoder import ACTIVATIONS, Encoder
from flock.model.linear import Linear
from flock.model.rope import RotaryEmbedding

LAYER_NAMES = {"attn.Wqkv": "qkv", "attn.Wo": "attn_out", "mlp.Wi": "up", "mlp.Wo": "down"}
RENAMES = {"embeddings.tok_embeddings.": "word_embeddings.", "embeddings.norm.": "embedding_norm.",
           "head.dense.": "head_dense.", "head.norm.": "head_norm."}


class ModernBertLayer(nn.Module):
    fused = False  # the rotary embedding by fused_ops, in place in the qkv output

    def __init__(self, c: ModelConfig, index: int, backend: AttentionBackend, rope: RotaryEmbedding):
        super().__init__()
        h, eps = c.hidden_size, c.rms_norm_eps
        self.window = c.layer_window(index)
        self.heads, self.act, self.backend, self.rope = c.num_attention_heads, ACTIVATIONS[c.hidden_act], backend, rope
        self.k_cache = self.v_cache = None  # the model's one cache pair
        self.attn_norm = nn.LayerNorm(h, eps, bias=c.norm_bias) if index else None  # the first layer's: none
        self.qkv, self.attn_out = Linear(h, 3 * h, bias=c.attention_bias), Linear(h, h, bias=c.attention_bias)
        self.mlp_norm = nn.LayerNorm(h, eps, bias=c.norm_bias)
        self.up = Linear(h, 2 * c.intermediate_size, bias=c.mlp_bias)  # [input | gate]
        self.down = Linear(c.intermediate_size, h, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output of every token, or of the tokens `rows` only (the others' K and V still count)."""
        qkv = self.qkv(x if self.attn_norm is None else self.attn_norm(x))
        if self.fused:
            head_dim = qkv.shape[1] // 3 // self.heads
            fused_ops.rope_(qkv, positions, self.rope.cos, self.rope.sin, 2 * self.heads, head_dim)
        q, k, v = qkv.unflatten(-1, (3, self.heads, -1)).unbind(1)  # each (tokens, heads, dim)
        if not self.fused:
            q, k = (t.to(x.dtype) for t in self.rope(positions, q.float(), k.float()))  # in float32, as transformers
        attended = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta)
        if rows is not None:
            attended, x = attended[rows], x[rows]
        x = x + self.attn_out(attended.flatten(1))
        inputs, gate = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(self.act(inputs) * gate)


class ModernBertEncoder(Encoder):
    def __init__(self, c: ModelConfig, sep_token_id: int | None, backends: dict[int | None, AttentionBackend]):
        super().__init__()
        self.config, h, eps = c, c.hidden_size, c.rms_norm_eps
        self.word_embeddings = nn.Embedding(c.vocab_size, h)
        self.embedding_norm = nn.LayerNorm(h, eps, bias=c.norm_bias)
        positions = c.max_position_embeddings
        ropes = {None: RotaryEmbedding(c, positions, torch.float32),
                 c.sliding_window: RotaryEmbedding(replace(c, rope_theta=c.local_rope_theta), positions, torch.float32)}
        self.layers = nn.ModuleList(ModernBertLayer(c, i, backends[c.layer_window(i)], ropes[c.layer_window(i)])
                                    for i in range(c.num_hidden_layers))
        self.final_norm = nn.LayerNorm(h, eps, bias=c.norm_bias)
        self.head_dense = Linear(h, h, bias=c.classifier_bias) if c.num_labels else None
        self.head_norm = nn.LayerNorm(h, eps, bias=c.norm_bias) if c.num_labels else None
        self.classifier = nn.Linear(h, c.num_labels) if c.num_labels else None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], pairs: list[bool]
              ) -> torch.Tensor:
        return self.embedding_norm(self.word_embeddings(input_ids))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_norm(x)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.head_norm(ACTIVATIONS[self.config.head_act](self.head_dense(pooled)))

    def param_slot(self, name: str) -> tuple[str, int | None] | None:
        name = name.removeprefix("model.")
        if name.startswith("decoder.") or (name.startswith("head.") and self.classifier is None):
            return None  # the masked LM's head
        if name.startswith("layers."):
            index, _, rest = name.removeprefix("layers.").partition(".")
            module, _, kind = rest.rpartition(".")
            return f"layers.{index}.{LAYER_NAMES.get(module, module)}.{kind}", None
        prefix = next((p for p in RENAMES if name.startswith(p)), None)
        return (name if prefix is None else RENAMES[prefix] + name[len(prefix):]), None
