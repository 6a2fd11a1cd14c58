"""The batched decode call of the PyTorch backends: a row far wider than the others is attended alone."""

import numpy as np
import pytest
import torch

from flock.attention.base import StepLayout
from tests.attention.test_backends import BS, HEAD_DIM, config, reference, run_backend


def grouped_decodes_and_a_loner() -> StepLayout:
    """Six decodes on a shared 8-block prefix with short own tails, and one decode with 30 blocks of its own:
    the grouped rows read ~1 block past their prefix, the loner 31."""
    free = list(np.random.default_rng(5).permutation(400))
    prefix = [free.pop() for _ in range(8)]
    tables, starts = [], []
    for i in range(6):
        starts.append(8 * BS + i)
        tables.append(np.array(prefix + [free.pop() for _ in range(-(-(starts[-1] + 1) // BS) - 8)]))
    starts.insert(3, 30 * BS + 2)
    tables.insert(3, np.array([free.pop() for _ in range(31)]))
    starts = np.array(starts)
    slots = np.array([t[s // BS] * BS + s % BS for t, s in zip(tables, starts)])
    return StepLayout(np.arange(len(starts) + 1), starts + 1, tables, BS, torch.from_numpy(slots))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_a_wide_decode_row_goes_alone_and_stays_exact(dtype, tol):
    layout = grouped_decodes_and_a_loner()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, h, HEAD_DIM, generator=gen, dtype=dtype) for h in (4, 2, 2))
    caches = [torch.randn(400, BS, 2, HEAD_DIM, generator=gen, dtype=dtype) for _ in range(2)]
    out, meta, kc, vc = run_backend("torch-cascade", config(4, 2), layout, q, k, v, *caches)
    assert [(c.start, c.end) for c in meta.prefills] == [(3, 4)]  # the loner, as a one-token chunk
    assert len(meta.decode_tokens) == 6 and meta.decode_mask.shape[-1] == 2 * BS  # the batch pads to 2 blocks
    assert (out.double() - reference(q, kc, vc, layout, 2)).abs().max().item() <= tol


def test_rows_of_similar_width_stay_batched():
    layout = grouped_decodes_and_a_loner()
    q, k, v = torch.randn(7, 4, HEAD_DIM), torch.randn(7, 2, HEAD_DIM), torch.randn(7, 2, HEAD_DIM)
    caches = torch.randn(400, BS, 2, HEAD_DIM), torch.randn(400, BS, 2, HEAD_DIM)
    out, meta, kc, vc = run_backend("torch", config(4, 2), layout, q, k, v, *caches)  # no groups: 33-38 vs 123
    assert meta.prefills == [] and len(meta.decode_tokens) == 7
    assert (out.double() - reference(q, kc, vc, layout, 2)).abs().max().item() <= 1e-5
