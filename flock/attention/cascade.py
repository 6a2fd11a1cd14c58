"""Prefix-sharing (cascade) attention in PyTorch.

Requests whose block tables begin with the same physical blocks form a group (see `sharing.py`). For each
group, all its query tokens attend to the shared prefix KV in one matrix product with no mask (the prefix
is read once per group, not once per request); each request attends to the rest of its context as in the
per-request backend; the two partial results are merged with their log-sum-exps:
    O = (O_a * exp(lse_a - m) + O_b * exp(lse_b - m)) / (exp(lse_a - m) + exp(lse_b - m)).
"""

from dataclasses import dataclass

import numpy as np
import torch

from flock.attention.base import StepLayout, write_kv
from flock.attention.sharing import find_prefix_groups
from flock.attention.torch_paged import TorchPagedBackend, TorchPagedMetadata


@dataclass
class CascadePrefix:
    blocks: torch.Tensor  # the shared prefix's physical blocks
    tokens: torch.Tensor  # offsets, in the step, of every query token of the group's members


@dataclass
class CascadeMetadata(TorchPagedMetadata):
    groups: list[CascadePrefix] | None = None


class TorchCascadeBackend(TorchPagedBackend):
    name = "torch-cascade"
    min_prefix_blocks = 2  # shorter shared runs are cheaper to read per request

    def build_metadata(self, layout: StepLayout) -> CascadeMetadata:
        bs = layout.block_size
        computed_before = layout.seq_lens - layout.query_lens
        groups = []
        if self.sliding_window is None:  # a window would put a mask on the prefix part
            groups = find_prefix_groups(layout.block_tables, computed_before // bs, self.min_prefix_blocks)
        context_start = np.zeros(len(layout.seq_lens), dtype=np.int64)
        prefixes = []
        for g in groups:
            context_start[g.members] = g.num_blocks * bs
            blocks = layout.block_tables[g.members[0]][: g.num_blocks]
            tokens = np.concatenate([np.arange(layout.query_start[i], layout.query_start[i + 1]) for i in g.members])
            prefixes.append(CascadePrefix(torch.from_numpy(blocks).to(layout.slot_mapping.device),
                                        torch.from_numpy(tokens).to(layout.slot_mapping.device)))
        base = super().build_metadata(layout, context_start)
        return CascadeMetadata(**vars(base), groups=prefixes)

    def forward(self, q, k, v, k_cache, v_cache, meta: CascadeMetadata) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if not meta.groups:
            return self.attend(q, k, v, k_cache, v_cache, meta, lse=None)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.empty(q.shape[:2], dtype=acc, device=q.device)
        out = self.attend(q, k, v, k_cache, v_cache, meta, lse=lse)
        for g in meta.groups:
            kp = self._gather(k_cache, g.blocks, 0)
            vp = self._gather(v_cache, g.blocks, 1)
            o_prefix, lse_prefix = self.grouped_attention(q[g.tokens], kp, vp, None, want_lse=True)
            out[g.tokens] = merge(o_prefix, lse_prefix, out[g.tokens], lse[g.tokens])
        return out


def merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Combine two attention results over disjoint key sets ([n, H, D] outputs, [n, H] LSEs)."""
    # w_a / (w_a + w_b) with w = exp(lse - max) is sigmoid(lse_a - lse_b)
    weight = torch.sigmoid(lse_a - lse_b)[..., None]
    return torch.lerp(o_b.to(weight.dtype), o_a.to(weight.dtype), weight).to(o_a.dtype)
