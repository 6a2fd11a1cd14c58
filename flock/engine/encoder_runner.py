import math
from dataclasses import replace

import numpy as np
import torch

from flock.attention import make_backend
from flock.attention.base import StepLayout
from flock.config import EngineConfig
from flock.engine.heap import zeroed
from flock.engine.kernels import prebuild_kernels
from flock.engine.runner import StepOutput, resolve_device
from flock.model import ResolvedModel, resolve_dtype
from flock.model.encoder import BertEncoder
from flock.model.modernbert import ModernBertEncoder
from flock.sched.base import StepPlan


class EncoderRunner:
    """The runner of a bidirectional encoder (flock/model/encoder.py): a step's prompts, each whole, packed into
    one forward pass, then each pooled or classified. Its paged KV cache holds one step's tokens of one layer:
    each request's blocks are freed in the step that computes it."""

    lora = None
    vision = None
    kv_bytes_per_block = 0  # of nothing kept between steps

    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int, sep_token_id: int | None):
        c = resolved.config
        self.device = resolve_device(config.device)
        self.dtype = self.kv_dtype = resolve_dtype(config.dtype, c, self.device)
        if self.device.type == "cpu":
            prebuild_kernels()
        self.block_size = config.block_size
        # a backend per layer window (None: the whole prompt), each planning the step for its own layers
        self.backends = {w: make_backend(config.attention, replace(c, sliding_window=w, sliding_layers=None),
                                         self.device, self.dtype) for w in dict.fromkeys(c.layer_windows)}
        self.backend = self.backends[c.layer_window(0)]
        encoder = ModernBertEncoder if c.model_type == "modernbert" else BertEncoder
        self.model = encoder(c, sep_token_id, self.backends).to(self.device, self.dtype)
        load_format = config.load_format
        if load_format == "auto":
            load_format = "dummy" if resolved.builtin else "safetensors"
        if load_format not in ("dummy", "safetensors") or resolved.gguf is not None:
            raise ValueError(f"load_format {load_format!r} is not supported for the encoder {resolved.folder} "
                             "(auto, safetensors, dummy)")
        with torch.no_grad():
            self.model.init_dummy(config.seed) if load_format == "dummy" else self.model.load(resolved.folder)
        self.model.eval()
        # a step's tokens (the budget, passed by at most one whole prompt), each request's last block part-filled
        self.num_blocks = config.num_kv_blocks or math.ceil((config.max_num_batched_tokens + max_model_len) /
                                                            self.block_size) + config.max_num_seqs
        shape = (self.num_blocks, self.block_size, c.num_attention_heads, c.head_dim)
        self.model.set_cache(zeroed(shape, self.dtype, self.device), zeroed(shape, self.dtype, self.device))
        self.paths = {"gemm": self.model.prepack() if config.ops in ("auto", "packed") else "F.linear",
                      "elementwise": self.model.use_fused_ops() if config.ops in ("auto", "fused") else "PyTorch ops",
                      "attention": self.attention_path}

    @property
    def attention_path(self) -> str:
        backend = self.backend
        return backend.name + (f" ({backend.isa})" if getattr(backend, "isa", None) else "") + ", bidirectional"

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        """Every scheduled prompt, whole, through the encoder; each request's embedding or class probabilities."""
        lengths = [n for _, n in plan.scheduled]
        counts = np.array(lengths, dtype=np.int64)
        query_start = np.concatenate([[0], np.cumsum(counts)])
        positions = np.arange(query_start[-1]) - np.repeat(query_start[:-1], counts)
        tables = [np.asarray(t, dtype=np.int64) for t in plan.block_tables]
        slots = np.concatenate([t[p // self.block_size] * self.block_size + p % self.block_size
                                for t, p in zip(tables, np.split(positions, query_start[1:-1]))])
        layout = StepLayout(query_start=query_start, seq_lens=counts, block_tables=tables, block_size=self.block_size,
                            slot_mapping=torch.from_numpy(slots).to(self.device))
        last = np.repeat(counts - 1, counts)  # every token sees its whole prompt, or its window's both ways
        metas = {w: backend.build_metadata(replace(layout, attend_ends=last if w is None else
                                                   np.minimum(positions + w - 1, last)))
                 for w, backend in self.backends.items()}
        ids = torch.tensor([t for req, _ in plan.scheduled for t in req.prompt_token_ids], device=self.device)
        tasks = [req.pooling.task for req, _ in plan.scheduled]
        pooled, rows = self.model(ids, torch.from_numpy(positions).to(self.device), lengths, metas,
                                  every_row=any(t.startswith("token_") for t in tasks),
                                  pairs=[req.pooling.pair for req, _ in plan.scheduled])
        out = StepOutput([], [])
        for i, ((req, _), task) in enumerate(zip(plan.scheduled, tasks)):
            pooling = req.pooling
            hidden = rows[i] if task.startswith("token_") else pooled[i]
            out.embeddings.append(self.model.classify(hidden, pooling.use_activation).tolist()
                                  if task.endswith("classify") else pooling.pool(hidden))
        return out
