"""The step's LoRA updates on a projection: each row gets x A^T B^T of its adapter added to the base output.

The step's adapters are stacked: one product gives every row's x A^T for all of them, the columns of adapters
other than the row's are zeroed (a mask, unless one adapter has every row), and one product with the stacked B
(each adapter's parts in their output columns) gives the updates: two small GEMMs and an add a projection,
however many adapters the step holds. bf16 models run them in one C call over Flock's bf16 GEMM
(csrc/gemm_lora.h, which the step program also records); others through PyTorch.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flock.model import gemm

MAX_STACKS = 4  # stacked weights kept a projection (for this many recent sets of adapters)


@dataclass
class Part:
    """An adapter's update of some output columns of a (fused) projection: q, k or v of qkv_proj, say."""

    columns: slice
    ranks: slice  # its rows of the adapter's A for this projection
    b: torch.Tensor  # [columns, rank], scaled


@dataclass
class ProjectionUpdate:
    a: torch.Tensor  # [sum of the parts' ranks, in_features]
    parts: list[Part]


@dataclass
class Stack:
    """Some adapters' updates of one projection, stacked; `owners` names each rank column's adapter."""

    shrink: torch.Tensor  # [ranks, in_features], or packed for Flock's GEMM
    expand: torch.Tensor  # [out_features, ranks], or packed
    ranks: int
    owners: torch.Tensor  # [ranks] adapter ids, int32 (-1: padding)


class StepAdapters:
    """Which adapter each row of the step runs, for all of its tokens and for the last layer's finished rows (a
    projection tells which by its input's row count)."""

    def __init__(self):
        self.num_rows = 0
        self.ids: tuple[int, ...] = ()  # the step's adapters
        self.all_rows: torch.Tensor | int = 0  # each row's adapter id (int64), or the one id of every row
        self.out_rows: torch.Tensor | int = 0

    def set(self, row_adapters: np.ndarray, out_rows: list[int] | None, device: torch.device) -> None:
        """`row_adapters`: each step row's adapter id (0: none); `out_rows`: the rows the last layer finishes."""
        self.num_rows = len(row_adapters)
        self.ids = tuple(a for a in np.unique(row_adapters).tolist() if a)
        self.all_rows = _rows(row_adapters, device)
        self.out_rows = self.all_rows if out_rows is None else _rows(row_adapters[out_rows], device)

    def clear(self) -> None:
        self.num_rows, self.ids, self.all_rows, self.out_rows = 0, (), 0, 0

    @property
    def active(self) -> bool:
        return bool(self.ids)

    def row_ids(self, num_rows: int, owners: torch.Tensor) -> torch.Tensor | None:
        """Each row's adapter id, to mask the rank columns of a stack with these owners; None where every row has
        the stack's one adapter (no mask)."""
        rows = self.all_rows if num_rows == self.num_rows else self.out_rows
        if not isinstance(rows, int):
            return rows
        if bool(((owners == rows) | (owners == -1)).all()):
            return None
        return torch.full((num_rows,), rows, dtype=torch.int64, device=owners.device)


def _rows(row_adapters: np.ndarray, device: torch.device) -> torch.Tensor | int:
    if len(row_adapters) and (row_adapters == row_adapters[0]).all():
        return int(row_adapters[0])
    return torch.from_numpy(row_adapters.astype(np.int64)).to(device)


class LinearLoRA:
    """A projection's updates by adapter id, and their stacks for the step's adapters."""

    def __init__(self, step: StepAdapters, packed: bool):
        self.step = step
        self.packed = packed  # on Flock's bf16 GEMM (csrc/gemm_lora.h), else PyTorch's products
        self.updates: dict[int, ProjectionUpdate] = {}
        self.stacks: dict[tuple[int, ...], Stack] = {}

    def stack(self, out_features: int) -> Stack | None:
        """The stacked updates of the step's adapters that update this projection (None: none does)."""
        ids = tuple(a for a in self.step.ids if a in self.updates)
        return (self.stacks.get(ids) or self._stack(ids, out_features)) if ids else None

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y + the updates of x's rows, in place."""
        stack = self.stack(y.shape[1])
        if stack is None:
            return y
        row_ids = self.step.row_ids(len(x), stack.owners)
        if self.packed:
            x = x if x.stride(-1) == 1 and x.stride(0) % 2 == 0 else x.contiguous()
            gemm.add_lora(y, x, stack.shrink, stack.ranks, stack.expand, row_ids, stack.owners)
            return y
        shrunk = F.linear(x, stack.shrink)
        if row_ids is not None:
            shrunk.mul_((row_ids[:, None] == stack.owners[None, :]).to(shrunk.dtype))
        return y.add_(F.linear(shrunk, stack.expand))

    def forget(self, adapter: int) -> None:
        self.updates.pop(adapter, None)
        self.stacks.clear()

    def _stack(self, ids: tuple[int, ...], out_features: int) -> Stack:
        updates = [self.updates[a] for a in ids]
        sizes = [u.a.shape[0] for u in updates]
        total = sum(sizes)
        while self.packed and not gemm.takes(total):  # padded with zero ranks to a width the GEMM takes (AMX: 32s)
            total += 1
        first = updates[0].a
        shrink = first.new_zeros(total, first.shape[1])
        expand = first.new_zeros(out_features, total)
        owners = [-1] * total
        at = 0
        for adapter, update, size in zip(ids, updates, sizes):
            shrink[at : at + size] = update.a
            for part in update.parts:
                expand[part.columns, at + part.ranks.start : at + part.ranks.stop] = part.b
            owners[at : at + size] = [adapter] * size
            at += size
        if self.packed:
            shrink, expand = gemm.pack(shrink), gemm.pack(expand)
        if len(self.stacks) >= MAX_STACKS:
            self.stacks.pop(next(iter(self.stacks)))
        self.stacks[ids] = Stack(shrink, expand, total, torch.tensor(owners, dtype=torch.int32, device=first.device))
        return self.stacks[ids]
