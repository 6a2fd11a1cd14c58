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
    def fail(path):
        raise subprocess.CalledProcessError(1, ["gcc"], stderr="gcc: command not found")

    fused_ops.KERNEL.clear()
    monkeypatch.setattr(fused_ops.KERNEL, "build", fail)
    yield
    fused_ops.KERNEL.clear()


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
    """bf16 on a CPU with AMX or AVX512-BF16: Flock's GEMM; elsewhere oneDNN's prepacked weights."""
    cpu = torch.device("cpu")
    got = paths(dtype="bfloat16")["gemm"]
    if gemm.unavailable(torch.bfloat16, cpu) is None:
        assert got == f"Flock bf16 GEMM ({gemm.isa()}), packed weights, SiLU-and-mul in its gate_up GEMM"
        mlp = LLM("flock/tiny", load_format="dummy", dtype="bfloat16").engine.runner.model.layers[0].mlp
        assert mlp.gate_up_proj.silu_and_mul and not mlp.down_proj.silu_and_mul
    else:
        why = linear.unavailable(torch.bfloat16, cpu)
        assert got == ("oneDNN, prepacked weights" if why is None else f"F.linear ({why})")


def two_steps(runner, sampled: bool):
    """Step 1: request A, 40 new tokens. Step 2: B and C continue a shared 32-token context (blocks 0-1) with 7
    and 3 new tokens, D starts fresh with 5. Steps sample A; B and C (not D). (layout, token ids, positions)."""
    bs = 16
    step1 = StepLayout(query_start=np.array([0, 40]), seq_lens=np.array([40]), block_tables=[np.arange(3)],
                       block_size=bs, slot_mapping=torch.arange(40), sampled=np.array([0]) if sampled else None)
    tables = [np.array([0, 1, 3]), np.array([0, 1, 4]), np.array([5])]
    slots = torch.cat([torch.arange(48, 55), torch.arange(64, 67), torch.arange(80, 85)])
    step2 = StepLayout(query_start=np.array([0, 7, 10, 15]), seq_lens=np.array([39, 35, 5]), block_tables=tables,
                       block_size=bs, slot_mapping=slots, sampled=np.array([0, 1]) if sampled else None)
    positions2 = torch.cat([torch.arange(32, 39), torch.arange(32, 35), torch.arange(5)])
    return [(step1, torch.arange(3, 43), torch.arange(40)), (step2, torch.arange(50, 65), positions2)]


@pytest.mark.parametrize("dtype, ops", [("float64", "auto"), ("float32", "torch"), ("float32", "auto"),
                                        ("bfloat16", "auto")])
def test_last_layer_for_the_sampled_rows_only_equals_every_row(dtype, ops):
    """out_rows: the last layer's attention output, MLP and norm for those tokens alone give their rows of the
    full forward, with the attention planned for their queries alone where the backend does (a layout that
    names its sampled requests; a shared prefix among them) or not, also for no rows at all (oneDNN may sum a
    GEMM of other rows in another order); the cache gets every token's K and V either way."""
    runner = LLM("flock/tiny", load_format="dummy", dtype=dtype, ops=ops, block_size=16).engine.runner
    model, backend = runner.model, runner.backend
    cache = model.attention_layers()[-1].k_cache.view(-1, model.config.num_key_value_heads, model.config.head_dim)
    close = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else {}
    with torch.inference_mode():
        for (full, ids, positions), (planned, _, _) in zip(two_steps(runner, False), two_steps(runner, True)):
            every = model(ids, positions, backend.build_metadata(full)).clone()  # (the step program's buffer)
            written = cache[full.slot_mapping].clone()
            rows = full.query_start[planned.sampled + 1] - 1
            for layout, out_rows in ((planned, rows), (full, rows), (full, [len(ids) - 1]), (full, [])):
                cache[full.slot_mapping] = 0
                got = model(ids, positions, backend.build_metadata(layout), torch.tensor(out_rows, dtype=torch.long))
                torch.testing.assert_close(got, every[out_rows], **close)
                assert torch.equal(cache[full.slot_mapping], written)
