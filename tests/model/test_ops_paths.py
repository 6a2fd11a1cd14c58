"""EngineConfig.ops: which speed paths a model gets, the fallbacks, and the errors naming why."""

import subprocess

import pytest
import numpy as np
import torch

from flock import LLM
from flock.attention.base import StepLayout
from flock.model import fused_ops, gemm, linear


@pytest.fixture
def no_compiler(monkeypatch):
    def fail(source, flags):
        raise subprocess.CalledProcessError(1, ["gcc"], stderr="gcc: command not found")

    fused_ops.load.cache_clear()
    monkeypatch.setattr(fused_ops, "build", fail)
    yield
    fused_ops.load.cache_clear()


def paths(**config) -> dict[str, str]:
    return LLM("flock/tiny", **config).engine.runner.paths


def test_without_a_compiler_auto_keeps_pytorch_ops_and_fused_is_an_error(no_compiler):
    got = paths(dtype="bfloat16")
    assert got["elementwise"].startswith("PyTorch ops (could not build the fused ops: gcc: command not found")
    with pytest.raises(ValueError, match="ops='fused': could not build the fused ops"):
        paths(dtype="bfloat16", ops="fused")


def test_float64_and_torch_run_the_reference_ops():
    assert paths(dtype="float64") == {"elementwise": "PyTorch ops (the fused kernels take bfloat16 and float32, "
                                                     "not torch.float64)",
                                      "gemm": "F.linear (prepacked weights take bfloat16 and float32, not "
                                              "torch.float64)"}
    assert paths(dtype="float32", ops="torch") == {"elementwise": "PyTorch ops", "gemm": "F.linear"}
    with pytest.raises(ValueError, match="ops='packed': prepacked weights take bfloat16 and float32"):
        paths(dtype="float64", ops="packed")


def test_unknown_ops_is_named():
    with pytest.raises(ValueError, match="ops must be one of auto, torch, fused, packed, got 'fast'"):
        LLM("flock/tiny", ops="fast")


@pytest.mark.skipif(fused_ops.unavailable(torch.float32, torch.device("cpu")) is not None, reason="no fused ops")
def test_auto_takes_both_paths_where_they_run():
    got = paths(dtype="float32")
    assert got["elementwise"] == f"fused C kernels ({fused_ops.isa()})"
    why = linear.unavailable(torch.float32, torch.device("cpu"))
    assert got["gemm"] == ("oneDNN, prepacked weights" if why is None else f"F.linear ({why})")


def test_bf16_gemm_takes_the_projections_where_it_runs():
    """bf16 on a CPU with AVX512-BF16 and no AMX: Flock's GEMM; elsewhere oneDNN's prepacked weights."""
    cpu = torch.device("cpu")
    got = paths(dtype="bfloat16")["gemm"]
    if gemm.unavailable(torch.bfloat16, cpu) is None:
        assert got == "Flock bf16 GEMM (avx512bf16), packed weights, SiLU-and-mul in its gate_up GEMM"
        mlp = LLM("flock/tiny", load_format="dummy", dtype="bfloat16").engine.runner.model.layers[0].mlp
        assert mlp.gate_up_proj.silu_and_mul and not mlp.down_proj.silu_and_mul
    else:
        why = linear.unavailable(torch.bfloat16, cpu)
        assert got == ("oneDNN, prepacked weights" if why is None else f"F.linear ({why})")


@pytest.mark.parametrize("dtype, ops", [("float64", "auto"), ("float32", "torch"), ("float32", "auto"),
                                        ("bfloat16", "auto")])
def test_last_layer_for_the_sampled_rows_only_equals_every_row(dtype, ops):
    """out_rows: the last layer's attention output, MLP and norm for those tokens alone give their rows of the
    full forward (also none at all; oneDNN may sum a GEMM of other rows in another order), and the cache gets
    every token's K and V either way."""
    runner = LLM("flock/tiny", load_format="dummy", dtype=dtype, ops=ops).engine.runner
    n = 37
    layout = StepLayout(query_start=np.array([0, n]), seq_lens=np.array([n]),
                        block_tables=[np.arange(-(-n // runner.block_size))], block_size=runner.block_size,
                        slot_mapping=torch.arange(n))
    ids, positions = torch.arange(3, 3 + n), torch.arange(n)
    with torch.inference_mode():
        every = runner.model(ids, positions, runner.backend.build_metadata(layout))
        cache = runner.model.attention_layers()[-1].k_cache.view(-1, runner.model.config.num_key_value_heads,
                                                                 runner.model.config.head_dim)
        written = cache[:n].clone()
        for rows in ([4, 0, n - 1], [n - 1], []):
            cache[:n] = 0
            got = runner.model(ids, positions, runner.backend.build_metadata(layout),
                               torch.tensor(rows, dtype=torch.long))
            torch.testing.assert_close(got, every[rows], rtol=1e-5 if dtype == "float32" else None,
                                       atol=1e-5 if dtype == "float32" else None)
            assert torch.equal(cache[:n], written)
