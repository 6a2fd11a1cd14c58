import numpy as np
import torch

from flock.attention import make_backend
from flock.attention.base import StepLayout
from flock.config import EngineConfig
from flock.model import ResolvedModel, apply_ops, build_model, resolve_dtype
from flock.sample.sampler import Sampler
from flock.sched.base import StepPlan

DEFAULT_KV_BYTES = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    """Turns a step plan into tensors (once per step), runs the model, samples the finished contexts."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int):
        c = resolved.config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, c, self.device)
        self.block_size = config.block_size
        self.backend = make_backend(config.attention, c, self.device, self.dtype)
        self.model = build_model(
            resolved, self.backend, config.load_format, self.dtype, self.device, max_model_len, config.seed
        )
        self.paths = apply_ops(self.model, config.ops, self.dtype, self.device)
        self.num_blocks = self._num_blocks(config)
        shape = (self.num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.sampler = Sampler(config.seed)

    @property
    def kv_bytes_per_block(self) -> int:
        c = self.model.config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * elem

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        budget = config.kv_cache_memory_bytes or DEFAULT_KV_BYTES
        blocks = budget // self.kv_bytes_per_block
        if blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget} holds no block of {self.kv_bytes_per_block} bytes")
        return blocks

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Run one forward pass; return the sampled token of every request whose context is now complete,
        in plan order (see `StepPlan.sampling`)."""
        input_ids, positions, layout, sample_rows = self._prepare(plan)
        meta = self.backend.build_metadata(layout)
        hidden = self.model(input_ids, positions, meta)
        if not sample_rows:
            return torch.empty(0, dtype=torch.long)
        sampling = plan.sampling()
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        tokens = self.sampler(logits, [r.params for r in sampling], [r.generator for r in sampling])
        return tokens.cpu()

    def _prepare(self, plan: StepPlan):
        bs = self.block_size
        ids, pos, slots, tables = [], [], [], []
        query_start = np.zeros(len(plan.scheduled) + 1, dtype=np.int64)
        seq_lens = np.empty(len(plan.scheduled), dtype=np.int64)
        sample_rows = []
        for i, (req, n) in enumerate(plan.scheduled):
            start = req.num_computed_tokens
            table = np.asarray(req.block_table, dtype=np.int64)
            p = np.arange(start, start + n)
            ids.extend(req.token_ids[start : start + n])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            tables.append(table)
            query_start[i + 1] = query_start[i] + n
            seq_lens[i] = start + n
            if req.samples and start + n == req.num_tokens:
                sample_rows.append(int(query_start[i + 1]) - 1)
        to = dict(device=self.device)
        layout = StepLayout(
            query_start=query_start,
            seq_lens=seq_lens,
            block_tables=tables,
            block_size=bs,
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(**to),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, **to)
        positions = torch.from_numpy(np.concatenate(pos)).to(**to)
        return input_ids, positions, layout, sample_rows
