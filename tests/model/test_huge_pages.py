"""Tensors carved from mappings asked for 2 MiB pages: shapes, alignment, sharing, and (where Linux has transparent
huge pages for madvised memory) the pages themselves, for the weights a decode step streams."""

import re
from pathlib import Path

import pytest
import torch

from flock.model import gemm, huge_pages, quant

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                               reason="no transparent huge pages for madvised memory here")


def huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mapping holding the tensor's first byte."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(m[1], 16) <= address < int(m[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


def test_shapes_alignment_and_sharing(monkeypatch):
    monkeypatch.setattr(huge_pages, "_shared", [None, 0])
    small = [huge_pages.empty((3, 5), torch.bfloat16) for _ in range(3)]
    big = huge_pages.empty((huge_pages.REGION // 4 + 1, 4), torch.uint8)
    for t in (*small, big):
        assert t.is_contiguous() and t.data_ptr() % huge_pages.ALIGN == 0
    assert small[0].untyped_storage().data_ptr() == small[2].untyped_storage().data_ptr()  # one shared region
    assert big.untyped_storage().data_ptr() != small[0].untyped_storage().data_ptr()
    for i, t in enumerate(small):
        t.fill_(i)
    assert [t.float().mean().item() for t in small] == [0.0, 1.0, 2.0]
    x = torch.randn(7, 9)
    assert torch.equal(huge_pages.empty((7, 9), x.dtype).copy_(x), x)
    assert huge_pages.empty((0, 4), torch.float32).shape == (0, 4)


@needs_thp
def test_packed_and_interleaved_weights_sit_on_2_mib_pages():
    packed = gemm.pack(torch.randn(1024, 2048).to(torch.bfloat16))  # 4 MiB
    blocks = torch.randint(0, 256, (1024, 2048 // 32 * 34), dtype=torch.uint8)  # Q8_0 rows, 2 MiB
    interleaved = quant.interleave(quant.QuantTensor(quant.KERNEL_TYPES["Q8_0"][0], blocks))
    assert interleaved.interleaved and huge_kib(packed) >= 2048 and huge_kib(interleaved.blocks) >= 2048
