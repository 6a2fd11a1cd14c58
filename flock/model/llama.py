"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, Granite, Gemma 1/2/3) over a paged KV cache."""

from collections import Counter
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn
import torch.nn.functional as F

from flock import native
from flock.attention.base import AttentionBackend, AttentionMetadata
from flock.model import fused_ops, moe, program, quant
from flock.model.config import ModelConfig
from flock.model.linear import Embedding, Linear
from flock.model.quant import QuantWeight
from flock.model.rope import RopeRows, RotaryEmbedding


TRIM_BYTES = 256 << 20  # prepack_weights gives the heap's free pages back after each this many bytes released


class RMSNorm(nn.Module):
    fused = False  # fused_ops kernels instead of the PyTorch ops below (the reference)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual: (norm(x + residual), x + residual), in place of x and residual if fused."""
        if self.fused:
            if residual is None:
                return fused_ops.rms_norm(x, self.kernel_weight(), self.eps)
            fused_ops.add_rms_norm_(x, residual, self.kernel_weight(), self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self._normalized(x).to(x.dtype)

    def _normalized(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics, as transformers computes them (also for float64 models)
        x32 = x.to(torch.float32)
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def kernel_weight(self) -> torch.Tensor:
        """The weight the fused kernels multiply by."""
        return self.weight


class GemmaRMSNorm(RMSNorm):
    """Gemma's: the weight an offset from 1, the normalized x times (1 + weight) in float32, then cast."""

    _kernel_weight: torch.Tensor | None = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normalized(x) * (1.0 + self.weight.float())).to(x.dtype)

    def kernel_weight(self) -> torch.Tensor:
        """1 + weight in the model's dtype (made once: the weights are loaded before the kernels run)."""
        if self._kernel_weight is None:
            self._kernel_weight = (1.0 + self.weight.float()).to(self.weight.dtype)
        return self._kernel_weight


def rms_norm(config: ModelConfig, size: int) -> RMSNorm:
    return (GemmaRMSNorm if config.gemma_norms else RMSNorm)(size, config.rms_norm_eps)


class Attention(nn.Module):
    fused = False  # rotary embedding by fused_ops, in place in the qkv output

    def __init__(self, config: ModelConfig, layer_id: int, backend: AttentionBackend):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = rms_norm(config, self.head_dim)
            self.k_norm = rms_norm(config, self.head_dim)
        self.window = config.layer_window(layer_id)
        self.rotates = config.rope_layers is None or config.rope_layers[layer_id]  # SmolLM3's NoPE layers do not
        self.backend = backend.for_window(self.window)
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding | RopeRows, positions: torch.Tensor,
                meta: AttentionMetadata, rows: torch.Tensor | None = None):
        """The output of every token, or of `rows` only (every token's K and V are cached either way)."""
        q, k, v = self.rotated_qkv(self.qkv_proj(x), rope, positions)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta.for_window(self.window))
        out = out.reshape(-1, self.q_size)
        return self.o_proj(out if rows is None else out[rows])

    def rotated_qkv(self, qkv: torch.Tensor, rope: RotaryEmbedding | RopeRows, positions: torch.Tensor):
        """q and k normalized (Qwen3) and with the rotary embedding applied, and v: [T, heads, head_dim] each."""
        if self.fused:
            if self.qk_norm:
                fused_ops.head_rms_norm_(qkv, self.q_norm.kernel_weight(), self.q_norm.eps, self.num_heads,
                                         self.head_dim)
                fused_ops.head_rms_norm_(qkv[:, self.q_size :], self.k_norm.kernel_weight(), self.k_norm.eps,
                                         self.num_kv_heads, self.head_dim)
            if self.rotates:
                fused_ops.rope_(qkv, positions, rope.cos, rope.sin, self.num_heads + self.num_kv_heads, self.head_dim)
        heads = self.num_heads + 2 * self.num_kv_heads
        q, k, v = qkv.view(-1, heads, self.head_dim).split([self.num_heads, self.num_kv_heads, self.num_kv_heads], 1)
        if not self.fused and self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotates and not self.fused:
            q, k = rope(positions, q, k)
        return q, k, v


class MLP(nn.Module):
    fused = False  # SiLU-and-mul (GELU-and-mul) by fused_ops

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        self.silu = config.hidden_act == "silu"  # else GELU (tanh approximation), Gemma's
        width = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * width, bias=False)
        self.down_proj = Linear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        return self.down_proj(h if self.gate_up_proj.silu_and_mul else self.act_and_mul(h))

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused_ops.silu_and_mul(gate_up) if self.silu else fused_ops.gelu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) if self.silu else F.gelu(gate, approximate="tanh")) * up


class SparseMoE(nn.Module):
    """A mixture of experts (Mixtral's, Qwen2-MoE's, Qwen3-MoE's): each token's top k experts by the router's
    float32 softmax, their outputs weighted and summed in expert order, as transformers sums them; Qwen2-MoE's
    shared expert added, gated by a sigmoid."""

    fused = False  # the shared expert's gated add by fused_ops

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.float32_weights = config.model_type == "mixtral"  # Qwen's are cast to the model's dtype first
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.shared_expert = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
        self.grouped: moe.Experts | None = None  # the experts in one C call (group_experts)

    def group_experts(self) -> None:
        """Run the experts in one C call (flock.model.moe) where their weights allow it: quantized, or packed for
        the bf16 GEMM, their SiLU-and-mul in the gate_up GEMM."""
        gate_ups, downs = [e.gate_up_proj for e in self.experts], [e.down_proj for e in self.experts]
        router = moe.Router(self.top_k, self.renormalize, self.float32_weights)
        if not all(g.silu_and_mul for g in gate_ups):
            return
        if all(g.qweight is not None and d.qweight is not None for g, d in zip(gate_ups, downs)):
            self.grouped = moe.quantized([g.qweight for g in gate_ups], [d.qweight for d in downs], router)
        elif all(g.pairs is not None and d.pairs is not None for g, d in zip(gate_ups, downs)):
            self.grouped = moe.packed([g.pairs for g in gate_ups], [d.pairs for d in downs], downs[0].out_features,
                                      downs[0].in_features, router)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not len(x):  # a step may finish no row of a layer
            return torch.zeros_like(x)
        logits = self.gate(x)
        out = self.grouped(x, logits) if self.grouped is not None else self.mixture(x, logits)
        if self.shared_expert is None:
            return out
        shared, gate = self.shared_expert(x), self.shared_expert_gate(x)
        if self.fused:
            fused_ops.add_gated_(out, shared, gate)
            return out
        return out + torch.sigmoid(gate) * shared

    def mixture(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_weights:
            weights = weights.to(logits.dtype)
        # the (token, expert) pairs sorted by expert: each expert's tokens one contiguous run of rows
        by_expert, order = chosen.flatten().sort(stable=True)
        experts, counts = torch.unique_consecutive(by_expert, return_counts=True)
        tokens = order // self.top_k
        runs = x[tokens].split(counts.tolist())
        ys = torch.cat([self.experts[expert](run) for expert, run in zip(experts.tolist(), runs)])
        # added to each token in expert order (index_add_ runs through its rows in order)
        return torch.zeros_like(x).index_add_(0, tokens, (ys * weights.flatten()[order, None]).to(x.dtype))


class ImageRows(NamedTuple):
    """A step's image inputs: the rows of image placeholder tokens, the features that replace their embeddings,
    and their DeepStack rows (Qwen3-VL's: (layers, rows, hidden), added to the first layers' outputs)."""

    rows: torch.Tensor
    features: torch.Tensor
    deepstack: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    fused = False  # Granite's residual_multiplier by fused_ops

    def __init__(self, config: ModelConfig, layer_id: int, backend: AttentionBackend):
        super().__init__()
        self.self_attn = Attention(config, layer_id, backend)
        self.mlp = SparseMoE(config) if config.moe_layers and config.moe_layers[layer_id] else MLP(config)
        self.input_layernorm = rms_norm(config, config.hidden_size)
        self.post_attention_layernorm = rms_norm(config, config.hidden_size)
        self.sandwich = config.sandwich_norms
        if self.sandwich:  # Gemma 2's and 3's: the attention and MLP outputs normalized before their residual add
            self.pre_feedforward_layernorm = rms_norm(config, config.hidden_size)
            self.post_feedforward_layernorm = rms_norm(config, config.hidden_size)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x, residual, rope, positions, meta, rows=None):
        """(this layer's MLP output, the residual stream before it); the next norm adds the two. With `rows`:
        of those tokens only."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, positions, meta, rows)
        if rows is not None:
            residual = residual[rows]
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(self.scaled(x), residual)
        return self.scaled(self.mlp(x)), residual

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        """A block's output as the residual stream adds it (Granite's residual_multiplier; fused: in place)."""
        if self.residual_multiplier == 1.0:
            return x
        if self.fused:
            fused_ops.scale_(x, self.residual_multiplier)
            return x
        return x * self.residual_multiplier


class LlamaForCausalLM(nn.Module):
    # our fused parameter -> the Hugging Face tensors stacked in it, in order
    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    step_program: program.StepProgram | None = None  # see use_step_program
    lora_step = None  # flock.lora.layers.StepAdapters of an engine serving LoRA adapters
    fuse_glu = True  # the dense MLPs' SiLU-and-mul in their gate_up GEMM where the GEMM can (see unfuse_glu)

    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.config = config
        # _weight: no random init (on the meta device its Python decomposition imports torch._dynamo: ~1.4 s)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend) for i in range(config.num_hidden_layers))
        self.norm = rms_norm(config, config.hidden_size)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.num_labels and not config.classifier_tokens:  # a classifier's head, from its checkpoint
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def finish_init(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        """Once the weights are on their device: tie them again and build the rope tables there."""
        self.tie_weights()
        c = self.config
        self.rope = RotaryEmbedding(c, max_positions, dtype).to(device)
        self.local_rope = self.rope  # of the sliding-window layers
        if c.local_rope_theta is not None:
            local = replace(c, rope_theta=c.local_rope_theta, rope_scaling=None)
            self.local_rope = RotaryEmbedding(local, max_positions, dtype).to(device)
        # Gemma's embedding scale is rounded to the model's dtype first, as transformers' buffer is
        scale = c.embedding_multiplier
        self.embedding_scale = float(torch.tensor(scale, dtype=dtype)) if c.gemma_norms else scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None, image_rows: ImageRows | None = None) -> torch.Tensor:
        """Final hidden states of every token, or of the tokens `out_rows` only: the last layer then runs its
        attention output, MLP and norm for those rows alone (a prefill step samples from a few of its tokens;
        the rest only leave K and V in the cache), as llama.cpp does. `image_rows`: a vision-language model's
        image features, which take the place of their rows' token embeddings. `positions`: each token's, or
        M-RoPE's [3, tokens] time, height and width positions of a step with image tokens."""
        program = self.step_program  # (not for images: see their spans)
        if image_rows is None and positions.dim() == 1 and program is not None and program.takes(input_ids, meta):
            if out_rows is None:
                return program.run(input_ids, positions, meta)  # (read before the next step overwrites it)
            x, residual = program.run_but_last(input_ids, positions, meta)
            return self._last_layer(x, residual, None, positions, meta, out_rows)
        x, residual = self.embed(input_ids), None
        deepstack = None
        if image_rows is not None:
            x[image_rows.rows] = image_rows.features.to(x.dtype)
            deepstack = image_rows.deepstack
        rope_rows = None
        if positions.dim() == 2:
            rope_rows = self.rope.rows(positions)
            positions = torch.arange(positions.shape[1], device=positions.device)
        for i, layer in enumerate(self.layers[:-1]):
            x, residual = layer(x, residual, rope_rows or self.rope_of(layer), positions, meta)
            if deepstack is not None and i < len(deepstack):  # added to the layer's output, on the MLP's share
                x = x.index_add(0, image_rows.rows, deepstack[i].to(x.dtype))
        return self._last_layer(x, residual, rope_rows, positions, meta, out_rows)

    def _last_layer(self, x, residual, rope_rows, positions, meta, out_rows):
        """The last layer and the model's norm, of the tokens out_rows only where given."""
        if out_rows is not None and meta.rows_only is not None:  # the backend planned the sampled rows' queries
            meta = meta.rows_only
        last = self.layers[-1]
        x, residual = last(x, residual, rope_rows or self.rope_of(last), positions, meta, out_rows)
        return self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embedding_scale if self.embedding_scale != 1.0 else x  # Granite's, Gemma's

    def rope_of(self, layer: DecoderLayer) -> RotaryEmbedding:
        return self.rope if layer.self_attn.window is None else self.local_rope

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; float32 from Flock's bf16 GEMM: rounded to bf16, logits of ~25 are multiples of 1/8, and a
        near tie of a greedy pick becomes a tie. `out`: float32 [rows, vocab] those GEMMs write into."""
        logits = self.lm_head.forward(hidden, float32=True, out=out)  # (no hooks: the module call costs ~50 us)
        if self.config.logits_scaling != 1.0:  # Granite's
            logits = logits / self.config.logits_scaling
        if cap := self.config.final_logit_softcapping:  # Gemma 2's
            logits = torch.tanh(logits / cap) * cap
        return logits

    def classify(self, hidden: torch.Tensor, activate: bool = True) -> torch.Tensor:
        """A sequence classifier's class logits of final hidden states (float32; a float64 model's float64),
        through its activation when `activate` (ModelConfig.classifier_activation)."""
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        logits = F.linear(hidden.to(dtype), self.score.weight.to(dtype))
        kind = self.config.classifier_activation if activate else "identity"
        return logits.softmax(-1) if kind == "softmax" else logits.sigmoid() if kind == "sigmoid" else logits

    def score_from_tokens(self, token_ids: list[int]) -> None:
        """A causal LM as a classifier (ModelConfig.classifier_tokens): its score rows from the LM head's rows of
        `token_ids` (a quantized head's dequantized), in float32 at least; from_2_way_softmax's one row is the
        second's minus the first's (the sigmoid of its logit is the second token's softmax probability against the
        first)."""
        head, ids = self.lm_head, torch.tensor(token_ids)
        rows = head.weight.detach()[ids] if head.qweight is None else quant.dequantize_rows(head.qweight, ids)
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
        if self.config.classifier_method == "from_2_way_softmax":
            rows = rows[1:] - rows[:1]
        self.score = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
        self.score.weight.data.copy_(rows)
        if not self.config.tie_word_embeddings:  # a classifier never computes logits: its own head is freed
            self.lm_head = None

    def use_step_program(self) -> str | None:
        """Run the decoder layers of the steps a StepProgram takes as one C call; returns why they cannot
        (then nothing changes), or None."""
        why = program.unavailable(self)
        if why is None:
            self.step_program = program.StepProgram(self)
        return why

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def use_fused_ops(self, on: bool = True) -> None:
        """Run RMSNorm (+ residual add), RoPE and SiLU-and-mul by the fused kernels (see fused_ops.unavailable)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP, SparseMoE, DecoderLayer)):
                module.fused = on

    def prepack_weights(self, pairs: bool = False) -> None:
        """Prepack every projection's weight for oneDNN (see linear.unavailable), or with `pairs` for Flock's
        bf16 GEMM (see gemm.unavailable), which also fuses the MLPs' SiLU-and-mul into their gate_up GEMM; the
        lm_head of tied embeddings keeps its weight, which the embedding reads."""
        gate_ups, released = self._silu_gate_ups(), 0
        for module in self.modules():
            if isinstance(module, Linear) and module.qweight is None:
                released += module.weight.nbytes
                module.prepack(keep_weight=module is self.lm_head and self.config.tie_word_embeddings, pairs=pairs,
                               silu_and_mul=id(module) in gate_ups)
                if released >= TRIM_BYTES:  # the released weights back to the system as they go
                    native.trim_heap()
                    released = 0
        native.trim_heap()
        self._group_experts()

    def use_quantized(self, weights: dict[str, QuantWeight]) -> None:
        """Multiply by (and look up embeddings in) quantized weights: module name -> its weight; the MLPs'
        SiLU-and-mul fused into their gate_up GEMM; a tied lm_head takes the embedding's."""
        if self.config.tie_word_embeddings and "embed_tokens" in weights:
            weights = {**weights, "lm_head": weights["embed_tokens"]}
        gate_ups = self._silu_gate_ups()
        modules = dict(self.named_modules())
        for name, weight in weights.items():
            module = modules[name]
            if isinstance(module, Linear):
                module.use_quantized(weight, silu_and_mul=id(module) in gate_ups)
            else:
                module.use_quantized(weight)
        self._group_experts()

    def _group_experts(self) -> None:
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.group_experts()

    def _silu_gate_ups(self) -> set[int]:
        """The gate_up projections whose GEMM may apply the MLP's SiLU-and-mul (not GeGLU's)."""
        dense = set() if self.fuse_glu else {id(layer.mlp) for layer in self.layers}
        return {id(m.gate_up_proj) for m in self.modules() if isinstance(m, MLP) and m.silu and id(m) not in dense}

    def unfuse_glu(self) -> None:
        """Run the dense MLPs' activation after their gate_up GEMM, not in it (a LoRA update of gate or up must be
        added to the GEMM's output first); call before prepack_weights."""
        self.fuse_glu = False
        for layer in self.layers:
            if isinstance(layer.mlp, MLP) and layer.mlp.gate_up_proj.qweight is not None:
                layer.mlp.gate_up_proj.silu_and_mul = False

    def quantized_types(self) -> dict[str, int]:
        """How many layers run on each quant type ("Q4_K+Q6_K": a fused weight of two)."""
        return dict(Counter(m.qweight.types for m in self.modules() if isinstance(m, Linear) and m.qweight is not None))
