"""The engine on a CUDA GPU gives the transformers reference's greedy tokens (bench/gpu_check.sh runs these on one).

float64 runs the torch backends (the Triton kernel computes in float32 at most on a GPU); the Triton cascade
kernel runs in float32 against a float32 reference, as the CPU fast paths are tested.
"""

import pytest
import torch

from tests.engine.test_parity import assert_no_leak, flock_greedy, hf_greedy, shared_prefix_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh)")


@pytest.mark.parametrize("attention", ["torch", "torch-cascade"])
@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_float64_greedy_on_cuda_matches_transformers(hf_folders, kind, attention):
    prompts = shared_prefix_prompts(seed=len(kind))
    expected = hf_greedy(hf_folders[kind], prompts)
    got, llm = flock_greedy(hf_folders[kind], prompts, device="cuda", block_size=8, attention=attention)
    assert llm.engine.runner.device.type == "cuda"
    assert got == expected
    assert_no_leak(llm)


@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm", "feather"])
@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3"])
def test_float32_greedy_with_the_triton_kernel_matches_transformers(hf_folders, kind, scheduler):
    prompts = shared_prefix_prompts(seed=len(kind))
    expected = hf_greedy(hf_folders[kind], prompts, dtype=torch.float32)
    got, llm = flock_greedy(hf_folders[kind], prompts, dtype="float32", device="cuda", block_size=8,
                            scheduler=scheduler, max_num_batched_tokens=24, attention="triton")
    runner = llm.engine.runner
    assert runner.backend.name == "triton" and runner.backend.uses_kernel(runner.device)
    assert got == expected
    assert llm.stats()["saving_rate"] > 0.2
    assert_no_leak(llm)
