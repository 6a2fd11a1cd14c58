"""Bidirectional encoders of BERT's family (BERT, RoBERTa, XLM-RoBERTa): embedding models and cross-encoders.

A step's prompts arrive whole and packed one after another; each attends to all of its own tokens through the
engine's attention backend (every token's attend end its prompt's last position), whose K and V go to one paged
cache all layers write in turn: nothing in it outlives the layer."""

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from flock.attention.base import AttentionBackend
from flock.model import gemm, linear
from flock.model.config import ModelConfig
from flock.model.linear import Linear
from flock.model.loader import safetensors_files

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# a checkpoint's tensors under the encoder's own names: the architecture's prefix, the layers' HF module paths
CHECKPOINT_PREFIXES = ("bert.", "roberta.")
LAYER_NAMES = {"attention.self.query": "qkv", "attention.self.key": "qkv", "attention.self.value": "qkv",
               "attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
               "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "mlp_norm"}
QKV = (".query.", ".key.", ".value.")  # the fused projection's parts, in its row order
# what a checkpoint may hold that no embedding or classification reads: the MLM and pretraining heads, buffers
UNUSED_TENSORS = ("cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")


class EncoderLayer(nn.Module):
    """Self-attention then an MLP, each added to its input and layer-normed after (BERT's post-norm)."""

    def __init__(self, c: ModelConfig, backend: AttentionBackend):
        super().__init__()
        h, eps = c.hidden_size, c.rms_norm_eps
        self.heads, self.act, self.backend = c.num_attention_heads, ACTIVATIONS[c.hidden_act], backend
        self.k_cache = self.v_cache = None  # the model's one cache pair
        self.qkv, self.attn_out = Linear(h, 3 * h), Linear(h, h)  # qkv: the query, key and value rows in turn
        self.up, self.down = Linear(h, c.intermediate_size), Linear(c.intermediate_size, h)
        self.attn_norm, self.mlp_norm = nn.LayerNorm(h, eps), nn.LayerNorm(h, eps)

    def forward(self, x: torch.Tensor, meta, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output of every token, or of the tokens `rows` only (the others' K and V still count)."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(1)  # each (tokens, heads, dim)
        attended = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta)
        if rows is not None:
            attended, x = attended[rows], x[rows]
        x = self.attn_norm(x + self.attn_out(attended.flatten(1)))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))


class EncoderModel(nn.Module):
    """BertModel / RobertaModel / XLMRobertaModel, and their ForSequenceClassification heads: the final hidden
    states of packed prompts, pooled to an embedding (ModelConfig.pooling) or classified from the first token."""

    def __init__(self, c: ModelConfig, sep_token_id: int | None, backend: AttentionBackend):
        super().__init__()
        self.config, self.sep_token_id = c, sep_token_id
        h = c.hidden_size
        self.word_embeddings = nn.Embedding(c.vocab_size, h)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings + c.position_offset, h)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, h) if c.type_vocab_size else None
        self.embedding_norm = nn.LayerNorm(h, c.rms_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(c, backend) for _ in range(c.num_hidden_layers))
        # BERT's classifier reads the pooler's tanh(dense(first row)); RoBERTa's its own dense and out_proj
        roberta = c.position_offset > 0
        self.pooler = nn.Linear(h, h) if c.num_labels and not roberta else None
        self.head_dense = nn.Linear(h, h) if c.num_labels and roberta else None
        self.classifier = nn.Linear(h, c.num_labels) if c.num_labels else None

    def set_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        for layer in self.layers:
            layer.k_cache, layer.v_cache = k_cache, v_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], meta) -> list[torch.Tensor]:
        """Each prompt's pooled final hidden state: the last layer finishes only the rows pooling reads (a
        prompt's first or last token's; all of them for a mean), as llama.cpp's out_ids spare a prefill's."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.config.position_offset)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(self.token_types(input_ids, lengths))
        x = self.embedding_norm(x)
        for layer in self.layers[:-1]:
            x = layer(x, meta)
        mode = "CLS" if self.classifier is not None else self.config.pooling
        if mode == "MEAN":
            x = self.layers[-1](x, meta)
            return [h.to(torch.promote_types(h.dtype, torch.float32)).mean(0) for h in x.split(lengths)]
        ends = torch.tensor(lengths, device=x.device).cumsum(0)
        rows = ends - torch.tensor(lengths, device=x.device) if mode == "CLS" else ends - 1
        return list(self.layers[-1](x, meta, rows))

    def token_types(self, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Each token's segment as a tokenizer's pair encoding gives it: 0 up to a prompt's first separator, 1
        after it (a single text: all 0)."""
        if self.sep_token_id is None or self.config.type_vocab_size < 2:
            return torch.zeros_like(input_ids)
        seps = (input_ids == self.sep_token_id).long()
        return torch.cat([(s.cumsum(0) - s).clamp(max=1) for s in seps.split(lengths)])

    def classify(self, first: torch.Tensor, use_activation: bool = True) -> torch.Tensor:
        """One prompt's class probabilities (logits when not `use_activation`) from its first token's final hidden
        state, in float32 (a float64 model's float64)."""
        head = self.pooler if self.pooler is not None else self.head_dense
        logits = self.classifier(torch.tanh(head(first))).to(torch.promote_types(first.dtype, torch.float32))
        kind = self.config.classifier_activation if use_activation else "identity"
        return logits.softmax(-1) if kind == "softmax" else logits.sigmoid() if kind == "sigmoid" else logits

    def load(self, folder: Path) -> None:
        """The weights of a Hugging Face folder's safetensors (ValueError naming a missing or unknown tensor)."""
        params = dict(self.named_parameters())
        loaded, h = set(), self.config.hidden_size
        files = safetensors_files(folder)
        if not files:
            raise FileNotFoundError(f"{folder}: no *.safetensors files (use load_format='dummy' for random weights)")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    ours = self.param_name(name)
                    if ours is None:
                        continue
                    if ours not in params:
                        raise ValueError(f"{file.name}: unexpected tensor {name!r} for {self.config.model_type}")
                    part = next((i for i, kind in enumerate(QKV) if kind in name), None) if ".qkv." in ours else None
                    target = params[ours].data if part is None else params[ours].data[part * h : (part + 1) * h]
                    tensor = f.get_tensor(name)
                    if tensor.shape != target.shape:
                        raise ValueError(f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                         f"{tuple(target.shape)}")
                    target.copy_(tensor)
                    loaded.add(ours if part is None else f"{ours}:{part}")
        expected = {f"{n}:{i}" if ".qkv." in n else n for n in params for i in range(3)}
        if missing := sorted(expected - loaded):
            raise ValueError(f"{folder}: missing tensor {missing[0]!r}" + (
                f" and {len(missing) - 1} more" if len(missing) > 1 else ""))

    def param_name(self, name: str) -> str | None:
        """A checkpoint tensor's parameter here (None: a tensor nothing here reads)."""
        name = next((name[len(p):] for p in CHECKPOINT_PREFIXES if name.startswith(p)), name)
        if name.startswith(UNUSED_TENSORS) or (name.startswith("pooler.") and self.pooler is None):
            return None
        if name.startswith("encoder.layer."):
            index, _, rest = name.removeprefix("encoder.layer.").partition(".")
            module, _, kind = rest.rpartition(".")
            return f"layers.{index}.{LAYER_NAMES.get(module, module)}.{kind}"
        renames = {"embeddings.LayerNorm.": "embedding_norm.", "embeddings.": "", "pooler.dense.": "pooler.",
                   "classifier.dense.": "head_dense.", "classifier.out_proj.": "classifier."}
        prefix = next((p for p in renames if name.startswith(p)), None)
        return name if prefix is None else renames[prefix] + name[len(prefix):]

    def prepack(self) -> str:
        """Pack every projection's weight once for the fastest GEMM that runs here (Flock's bf16 GEMM, else
        oneDNN's); the path taken."""
        dtype, device = self.layers[0].qkv.weight.dtype, self.layers[0].qkv.weight.device
        pairs = gemm.unavailable(dtype, device) is None
        why = linear.unavailable(dtype, device)
        if not pairs and why is not None:
            return f"F.linear ({why})"
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(pairs=pairs)
        return f"Flock bf16 GEMM ({gemm.isa()}), packed weights" if pairs else "oneDNN, prepacked weights"

    def init_dummy(self, seed: int) -> None:
        """Random weights, reproducible from the seed whatever the dtype (drawn in float32, then cast)."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            norm = "norm." in name
            values = (torch.ones if name.endswith("weight") else torch.zeros)(param.shape) if norm \
                else torch.randn(param.shape, generator=gen) * 0.02
            param.data.copy_(values)
