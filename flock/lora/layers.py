"""The step's LoRA updates on a projection: its rows of each adapter get x A^T B^T added to the base output."""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Part:
    """An adapter's update of some output columns of a (fused) projection: q, k or v of qkv_proj, say."""

    columns: slice
    ranks: slice  # its rows of the projection's stacked A
    b: torch.Tensor  # [columns, rank], scaled


@dataclass
class ProjectionUpdate:
    a: torch.Tensor  # [sum of the parts' ranks, in_features]: one product gives every part's x A^T
    parts: list[Part]

    def add_to(self, y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None) -> None:
        shrunk = (x if rows is None else x.index_select(0, rows)) @ self.a.T
        for part in self.parts:
            delta = shrunk[:, part.ranks] @ part.b.T
            if rows is None:
                y[:, part.columns] += delta
            else:
                y[:, part.columns].index_add_(0, rows, delta)


class StepAdapters:
    """Which rows of the step run which adapter, for all of its tokens and for the last layer's finished rows
    (a projection tells which by its input's row count)."""

    def __init__(self):
        self.num_rows = 0
        self.all_rows: list[tuple[int, torch.Tensor | None]] = []  # (adapter id, its rows; None: every row)
        self.out_rows: list[tuple[int, torch.Tensor | None]] = []

    def set(self, row_adapters: np.ndarray, out_rows: list[int] | None, device: torch.device) -> None:
        """`row_adapters`: each step row's adapter id (0: none); `out_rows`: the rows the last layer finishes."""
        self.num_rows = len(row_adapters)
        self.all_rows = _runs(row_adapters, device)
        self.out_rows = _runs(row_adapters[out_rows], device) if out_rows is not None else self.all_rows

    def clear(self) -> None:
        self.num_rows, self.all_rows, self.out_rows = 0, [], []

    @property
    def active(self) -> bool:
        return bool(self.all_rows)

    def of(self, num_rows: int) -> list[tuple[int, torch.Tensor | None]]:
        return self.all_rows if num_rows == self.num_rows else self.out_rows


def _runs(row_adapters: np.ndarray, device: torch.device) -> list[tuple[int, torch.Tensor | None]]:
    out = []
    for adapter in np.unique(row_adapters).tolist():
        if adapter:
            rows = np.flatnonzero(row_adapters == adapter)
            out.append((adapter, None if len(rows) == len(row_adapters) else torch.from_numpy(rows).to(device)))
    return out


class LinearLoRA:
    """A projection's updates by adapter id, applied to the rows of each that the step holds."""

    def __init__(self, step: StepAdapters):
        self.step = step
        self.updates: dict[int, ProjectionUpdate] = {}

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for adapter, rows in self.step.of(len(x)):
            update = self.updates.get(adapter)
            if update is not None:
                update.add_to(y, x, rows)
        return y
