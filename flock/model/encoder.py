"""Bidirectional encoders: what every one of them does (`Encoder`), and BERT's family (BERT, RoBERTa,
XLM-RoBERTa) as embedding models and cross-encoders. ModernBERT: flock/model/modernbert.py.

A step's prompts arrive whole and packed one after another; each attends to all of its own tokens (a windowed
layer's: those within its window on both sides) through the engine's attention backend, whose K and V go to one
paged cache all layers write in turn: nothing in it outlives the layer."""

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from flock.attention.base import AttentionBackend
from flock.model import fused_ops, gemm, linear
from flock.model.config import ModelConfig
from flock.model.linear import Linear
from flock.model.loader import safetensors_files

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# a BERT checkpoint's tensors under the encoder's own names: the architecture's prefix, the layers' HF module paths
BERT_PREFIXES = ("bert.", "roberta.")
BERT_LAYER_NAMES = {"attention.self.query": "qkv", "attention.self.key": "qkv", "attention.self.value": "qkv",
                    "attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
                    "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "mlp_norm"}
BERT_RENAMES = {"embeddings.LayerNorm.": "embedding_norm.", "embeddings.": "", "pooler.dense.": "pooler.",
                "classifier.dense.": "head_dense.", "classifier.out_proj.": "classifier."}
QKV = (".query.", ".key.", ".value.")  # BERT's parts of the fused projection, in its row order
# what a checkpoint may hold that no embedding or classification reads: the MLM and pretraining heads, buffers
UNUSED_TENSORS = ("cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")


class Encoder(nn.Module):
    """What the runner asks of an encoder: each prompt's pooled final hidden state (the last layer finishes only
    the rows pooling reads: a prompt's first or last token's, all of them for a mean, as llama.cpp's out_ids
    spare a prefill's), class probabilities from it, its weights loaded or drawn, its projections packed.
    Subclasses build `layers` (each with a `window`: None, or the kernels' window W: W - 1 positions on either
    side), `classifier` (None: an embedding model) and say how tokens are embedded and a pooled row classified."""

    config: ModelConfig
    layers: nn.ModuleList
    classifier: nn.Linear | None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], metas: dict,
                every_row: bool = False, pairs: list[bool] | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Each prompt's pooled row and, with `every_row` (a token task's), all of its rows' final states;
        `metas`: the attention metadata of each layer window (None: the whole prompt); `pairs`: which prompts are
        a cross-encoder's pairs of texts (None: none)."""
        x = self.embed(input_ids, positions, lengths, pairs or [False] * len(lengths))
        for layer in self.layers[:-1]:
            x = layer(x, positions, metas[layer.window])
        last = self.layers[-1]
        mode = self.config.classifier_pooling if self.classifier is not None else self.config.embedding_pooling
        if mode == "MEAN" or every_row:
            rows = self.finish(last(x, positions, metas[last.window])).split(lengths)
            return [h.to(torch.promote_types(h.dtype, torch.float32)).mean(0) if mode == "MEAN" else
                    h[0] if mode == "CLS" else h[-1] for h in rows], list(rows) if every_row else None
        ends = torch.tensor(lengths, device=x.device).cumsum(0)
        rows = ends - torch.tensor(lengths, device=x.device) if mode == "CLS" else ends - 1
        return list(self.finish(last(x, positions, metas[last.window], rows))), None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], pairs: list[bool]
              ) -> torch.Tensor:
        raise NotImplementedError

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output as the model gives it (a final norm)."""
        return x

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """A classifier's features of a pooled row, before its `classifier` matrix."""
        raise NotImplementedError

    def classify(self, pooled: torch.Tensor, use_activation: bool = True) -> torch.Tensor:
        """One prompt's class probabilities (logits when not `use_activation`) from its pooled row (a token
        classifier's: each token's, from its rows), in float32 (a float64 model's float64)."""
        logits = self.classifier(self.head(pooled)).to(torch.promote_types(pooled.dtype, torch.float32))
        kind = self.config.classifier_activation if use_activation else "identity"
        return logits.softmax(-1) if kind == "softmax" else logits.sigmoid() if kind == "sigmoid" else logits

    @property
    def windows(self) -> set[int | None]:
        return {layer.window for layer in self.layers}

    def set_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        for layer in self.layers:
            layer.k_cache, layer.v_cache = k_cache, v_cache

    def param_slot(self, name: str) -> tuple[str, int | None] | None:
        """A checkpoint tensor's parameter here, and its part of the rows of a fused one (None: all of them); None
        for a tensor nothing here reads."""
        raise NotImplementedError

    def load(self, folder: Path) -> None:
        """The weights of a Hugging Face folder's safetensors (ValueError naming a missing or unknown tensor)."""
        params = dict(self.named_parameters())
        files, loaded = safetensors_files(folder), set()
        if not files:
            raise FileNotFoundError(f"{folder}: no *.safetensors files (use load_format='dummy' for random weights)")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    slot = self.param_slot(name)
                    if slot is None:
                        continue
                    ours, part = slot
                    if ours not in params:
                        raise ValueError(f"{file.name}: unexpected tensor {name!r} for {self.config.model_type}")
                    target = params[ours].data
                    if part is not None:
                        rows = target.shape[0] // len(QKV)
                        target = target[part * rows : (part + 1) * rows]
                    tensor = f.get_tensor(name)
                    if tensor.shape != target.shape:
                        raise ValueError(f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                         f"{tuple(target.shape)}")
                    target.copy_(tensor)
                    loaded.add(ours if part is None else f"{ours}:{part}")
        fused = {n for n in params if self.fused_in_checkpoint(n)}
        expected = (set(params) - fused) | {f"{n}:{i}" for n in fused for i in range(len(QKV))}
        if missing := sorted(expected - loaded):
            raise ValueError(f"{folder}: missing tensor {missing[0]!r}" + (
                f" and {len(missing) - 1} more" if len(missing) > 1 else ""))

    def fused_in_checkpoint(self, name: str) -> bool:
        """Whether a parameter here is several checkpoint tensors stacked (BERT's q, k and v)."""
        return False

    def prepack(self) -> str:
        """Pack every projection's weight once for the fastest GEMM that runs here (Flock's bf16 GEMM, else
        oneDNN's); the path taken."""
        weight = self.layers[0].qkv.weight
        pairs = gemm.unavailable(weight.dtype, weight.device) is None
        why = linear.unavailable(weight.dtype, weight.device)
        if not pairs and why is not None:
            return f"F.linear ({why})"
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(pairs=pairs)
        return f"Flock bf16 GEMM ({gemm.isa()}), packed weights" if pairs else "oneDNN, prepacked weights"

    def use_fused_ops(self) -> str:
        """The fused C kernels where a layer has one to use (ModernBERT's rotary embedding); the path taken."""
        weight = self.layers[0].qkv.weight
        why = fused_ops.unavailable(weight.dtype, weight.device)
        if why is not None:
            return f"PyTorch ops ({why})"
        fused = [layer for layer in self.layers if hasattr(layer, "fused")]
        for layer in fused:
            layer.fused = True
        return f"fused C kernels ({fused_ops.isa()}): the rotary embedding" if fused else "PyTorch ops"

    def init_dummy(self, seed: int) -> None:
        """Random weights, reproducible from the seed whatever the dtype (drawn in float32, then cast)."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            norm = "norm." in name
            values = (torch.ones if name.endswith("weight") else torch.zeros)(param.shape) if norm \
                else torch.randn(param.shape, generator=gen) * 0.02
            param.data.copy_(values)


class BertLayer(nn.Module):
    """Self-attention then an MLP, each added to its input and layer-normed after (BERT's post-norm)."""

    window = None

    def __init__(self, c: ModelConfig, backend: AttentionBackend):
        super().__init__()
        h, eps = c.hidden_size, c.rms_norm_eps
        self.heads, self.act, self.backend = c.num_attention_heads, ACTIVATIONS[c.hidden_act], backend
        self.k_cache = self.v_cache = None  # the model's one cache pair
        self.qkv, self.attn_out = Linear(h, 3 * h), Linear(h, h)  # qkv: the query, key and value rows in turn
        self.up, self.down = Linear(h, c.intermediate_size), Linear(c.intermediate_size, h)
        self.attn_norm, self.mlp_norm = nn.LayerNorm(h, eps), nn.LayerNorm(h, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output of every token, or of the tokens `rows` only (the others' K and V still count)."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(1)  # each (tokens, heads, dim)
        attended = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta)
        if rows is not None:
            attended, x = attended[rows], x[rows]
        x = self.attn_norm(x + self.attn_out(attended.flatten(1)))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))


class BertEncoder(Encoder):
    """BertModel / RobertaModel / XLMRobertaModel, and their ForSequenceClassification heads (classifying the
    first token: through BERT's pooler, or RoBERTa's dense head)."""

    def __init__(self, c: ModelConfig, sep_token_id: int | None, backends: dict[int | None, AttentionBackend]):
        super().__init__()
        self.config, self.sep_token_id = c, sep_token_id
        h = c.hidden_size
        self.word_embeddings = nn.Embedding(c.vocab_size, h)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings + c.position_offset, h)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, h) if c.type_vocab_size else None
        self.embedding_norm = nn.LayerNorm(h, c.rms_norm_eps)
        self.layers = nn.ModuleList(BertLayer(c, backends[None]) for _ in range(c.num_hidden_layers))
        roberta, sequence = c.position_offset > 0, c.num_labels and not c.token_classifier
        self.pooler = nn.Linear(h, h) if sequence and not roberta else None  # a token classifier: no head
        self.head_dense = nn.Linear(h, h) if sequence and roberta else None
        self.classifier = nn.Linear(h, c.num_labels) if c.num_labels else None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], pairs: list[bool]
              ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.config.position_offset)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(self.token_types(input_ids, lengths, pairs))
        return self.embedding_norm(x)

    def token_types(self, input_ids: torch.Tensor, lengths: list[int], pairs: list[bool]) -> torch.Tensor:
        """Each token's segment as a tokenizer's encoding gives it: a pair's 0 up to its first separator, 1 after
        it; a single text's all 0 (a [SEP] within its text included)."""
        if self.sep_token_id is None or self.config.type_vocab_size < 2 or not any(pairs):
            return torch.zeros_like(input_ids)
        seps = (input_ids == self.sep_token_id).long()
        return torch.cat([(s.cumsum(0) - s).clamp(max=1) if pair else torch.zeros_like(s)
                          for s, pair in zip(seps.split(lengths), pairs)])

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        head = self.pooler if self.pooler is not None else self.head_dense
        return pooled if head is None else torch.tanh(head(pooled))

    def fused_in_checkpoint(self, name: str) -> bool:
        return ".qkv." in name

    def param_slot(self, name: str) -> tuple[str, int | None] | None:
        name = next((name[len(p):] for p in BERT_PREFIXES if name.startswith(p)), name)
        if "LayerNorm." in name:  # the names of checkpoints converted from TensorFlow, as transformers reads them
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if name.startswith(UNUSED_TENSORS) or (name.startswith("pooler.") and self.pooler is None):
            return None
        if name.startswith("encoder.layer."):
            index, _, rest = name.removeprefix("encoder.layer.").partition(".")
            module, _, kind = rest.rpartition(".")
            part = next((i for i, p in enumerate(QKV) if p in f".{module}."), None)
            return f"layers.{index}.{BERT_LAYER_NAMES.get(module, module)}.{kind}", part
        prefix = next((p for p in BERT_RENAMES if name.startswith(p)), None)
        return (name if prefix is None else BERT_RENAMES[prefix] + name[len(prefix):]), None
