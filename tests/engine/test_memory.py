"""The CPU runner's KV caches are mapped, not touched, at start-up: a run holds in memory the blocks it writes."""

import os
from pathlib import Path

import pytest
import torch

from flock import LLM, SamplingParams
from flock.engine.heap import zeroed

STATM = Path("/proc/self/statm")
needs_statm = pytest.mark.skipif(not STATM.exists(), reason="resident memory is read from Linux's /proc")


def resident_bytes() -> int:
    return int(STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@needs_statm
def test_a_zeroed_tensor_is_resident_only_where_written():
    before = resident_bytes()
    cache = zeroed((4096, 16, 8, 64), torch.bfloat16, torch.device("cpu"))  # 64 MiB
    assert cache.shape == (4096, 16, 8, 64) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()  # read: the kernel's zero page, nothing allocated
    assert resident_bytes() - before < 8 << 20
    cache[7].fill_(1.5)  # one block, 16 KiB
    assert resident_bytes() - before < 8 << 20
    assert cache.sum().item() == 1.5 * cache[7].numel() and cache[7].eq(1.5).all()


def test_zeroed_elsewhere_is_torch_zeros():
    assert zeroed((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)
    assert not zeroed((3, 5), torch.float16, torch.device("meta")).is_cpu


@needs_statm
def test_an_engines_kv_budget_costs_no_memory_until_used(hf_folders):
    before = resident_bytes()
    llm = LLM(str(hf_folders["llama"]), dtype="float32", kv_cache_memory_bytes=2 << 30)
    assert llm.engine.runner.num_blocks * llm.engine.runner.kv_bytes_per_block > 1.9 * 2**30
    assert resident_bytes() - before < 512 << 20  # zeroed whole, the caches alone would take 2 GiB
    out = llm.generate(["a b c d e f"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_kv_budget_and_length_options_as_vllm():
    """kv_cache_memory_bytes 0 is refused (it was the default 1 GiB); max_model_len -1 is the model's length, at
    most what the cache holds (vLLM's "what fits"); 0 or below -1 is refused."""
    from flock.config import EngineConfig

    for bad in (dict(kv_cache_memory_bytes=0), dict(max_model_len=0), dict(max_model_len=-2)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig.from_kwargs("flock/tiny", **bad)
    assert LLM("flock/tiny", max_model_len=-1, num_kv_blocks=4, block_size=16).engine.max_model_len == 64
