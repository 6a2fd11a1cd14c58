"""The step program (flock.model.program): a step's layers in one C call (a prefill's but for its last layer)
give the bits the modules' forward gives, for every quant mix, bias and dtype, and for bf16 weights on Flock's
bf16 GEMM; where it cannot run, the layers run as before."""

import ctypes

import pytest
import torch

from flock import LLM, SamplingParams
from flock.attention import cpu
from flock.model import fused_ops, gemm, program
from tests.engine.test_parity import shared_prefix_prompts
from tests.model.gguf_files import Q, write_gguf
from tests.model.test_quant_models import K_MIX

pytestmark = pytest.mark.skipif(cpu.kernel_unavailable() is not None, reason="no CPU attention kernel here")

CASES = {"K-quants": ("llama256", Q.Q4_K, K_MIX), "Q4_1 with qkv bias": ("qwen2", Q.Q4_1, None),
         "Q8_0 with q/k norms": ("qwen3", Q.Q8_0, None),
         "Q8_0": ("llama", Q.Q8_0, None), "Qwen3-MoE Q8_0": ("qwen3_moe", Q.Q8_0, None),
         "Gemma Q8_0": ("gemma", Q.Q8_0, None),  # GeGLU, norms offset from 1
         "Gemma 2 Q8_0": ("gemma2", Q.Q8_0, None),  # four norms a layer, capped scores, a window on every other
         "Gemma 3 Q4_0": ("gemma3", Q.Q4_0, None),  # q/k norms, windows with their own rope base
         "Qwen2-MoE Q8_0": ("qwen2_moe", Q.Q8_0, None)}  # a shared expert under a sigmoid gate


@pytest.fixture(scope="module")
def gguf_models(hf_folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("program")
    return {name: write_gguf(hf_folders[kind], root / f"{kind}-{qtype.name}.gguf", qtype, types)
            for name, (kind, qtype, types) in CASES.items()}


def generate(llm: LLM, prompts, max_tokens: int = 6):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def counting(monkeypatch) -> tuple[list[int], list[int]]:
    """Rows of each step the program runs whole, and of each it runs but for the last layer, from now on."""
    runs, partial = [], []
    for name, rows in (("run", runs), ("run_but_last", partial)):
        def counted(self, x, positions, meta, run=getattr(program.StepProgram, name), rows=rows):
            rows.append(len(x))
            return run(self, x, positions, meta)

        monkeypatch.setattr(program.StepProgram, name, counted)
    return runs, partial


def assert_the_layers_bits(monkeypatch, model, seed: int, **engine) -> LLM:
    """Two engines of `model`: the one with the step program (returned) gives the tokens and logprobs of the one
    without, exactly, on a shared-prefix batch whose decode steps the program runs with a growing row count, and
    its prefill steps but for their last layer."""
    llm, plain = (LLM(str(model), kv_cache_memory_bytes=1 << 22, **engine) for _ in range(2))
    plain.engine.runner.model.step_program = None  # (a second run of one engine would hit its prefix cache)
    prompts = shared_prefix_prompts(seed=seed)
    runs, partial = counting(monkeypatch)
    with_program = generate(llm, prompts)
    assert runs and max(runs) > 1 and partial
    assert generate(plain, prompts) == with_program
    return llm


# a float32 mixture's router runs on oneDNN, outside the program (test_where_the_program_cannot_run)
@pytest.mark.parametrize("case, dtype", [(case, dtype) for case in CASES for dtype in ("float32", "bfloat16")
                                         if "MoE" not in case or dtype == "bfloat16"])
def test_the_program_gives_the_layers_bits(gguf_models, case, dtype, monkeypatch):
    """Same tokens and logprobs, exactly, with the program and without, on shared-prefix batches whose decode
    steps have cascade segments, merges and a growing row count."""
    llm = assert_the_layers_bits(monkeypatch, gguf_models[case], 11, dtype=dtype, quantization="gguf")
    assert "quantized" in llm.engine.runner.paths
    assert llm.engine.runner.paths["step"] == "a step's layers in one C call (a prefill's last in Python)"


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_program_writes_and_reads_fp8_caches_as_the_layers_do(gguf_models, kv, dtype, monkeypatch):
    """An fp8 KV cache: the program's quantizing KV write and the kernel over fp8 rows give the layers' bits."""
    assert_the_layers_bits(monkeypatch, gguf_models["Q8_0"], 12, dtype=dtype, quantization="gguf", kv_cache_dtype=kv)


def test_timing_the_ops_keeps_the_bits_and_times_every_kind(gguf_models):
    """With op_seconds set, a step runs flock_run_program_timed: the same tokens, and a time for each kind of op."""
    llm, plain = (LLM(str(gguf_models["Q4_1 with qkv bias"]), dtype="float32", quantization="gguf",
                      kv_cache_memory_bytes=1 << 22) for _ in range(2))
    plain.engine.runner.model.step_program = None
    llm.engine.runner.model.step_program.op_seconds = {}
    prompts = shared_prefix_prompts(seed=14)
    assert generate(llm, prompts) == generate(plain, prompts)
    steps = llm.engine.runner.model.step_program
    times = steps.op_seconds
    kinds = {"input norm", "qkv GEMM", "qkv bias", "rope", "KV write", "attention", "o GEMM", "post-attention norm",
             "gate_up GEMM", "down GEMM", "final norm"}
    assert set(times) == kinds | ({"embedding"} if steps.embeds else set())
    assert all(t > 0 for t in times.values())


# the bf16 GEMM this CPU takes by default, and the AVX512-BF16 one (Zen 4/5's) where it runs here too
BF16_GEMMS = [p for p in dict.fromkeys([gemm.isa(), "avx512bf16"])
              if p and gemm.unavailable(torch.bfloat16, torch.device("cpu")) is None
              and (p != "avx512bf16" or gemm.KERNEL.unavailable(p) is None)]


@pytest.mark.skipif(not BF16_GEMMS, reason="no bf16 GEMM on this CPU")
@pytest.mark.parametrize("path", BF16_GEMMS or [None])
# SmolLM3: no rope on its NoPE layers; the mixtures' experts packed, in one call a layer; Gemma's layers; a partial
# rotary factor; Granite's multipliers
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "smollm3", "qwen3_moe", "qwen2_moe", "mixtral", "gemma2",
                                  "gemma3", "phi3_partial", "granite"])
def test_bf16_weights_run_on_the_bf16_gemm_with_the_layers_bits(hf_folders, kind, path, monkeypatch):
    monkeypatch.setattr(gemm, "isa", lambda: path)
    llm = assert_the_layers_bits(monkeypatch, hf_folders[kind], 13, dtype="bfloat16")
    assert f"({path})" in llm.engine.runner.paths["gemm"]


def test_steps_above_max_rows_run_the_layers(gguf_models, monkeypatch):
    llm, plain = (LLM(str(gguf_models["Q8_0"]), dtype="float32", kv_cache_memory_bytes=1 << 22, max_num_seqs=5)
                  for _ in range(2))
    prompts = shared_prefix_prompts(seed=12)
    plain.engine.runner.model.step_program = None
    expected = generate(plain, prompts, max_tokens=12)
    monkeypatch.setattr(program, "MAX_ROWS", 3)
    runs, partial = counting(monkeypatch)
    assert generate(llm, prompts, max_tokens=12) == expected
    assert runs and max(runs + partial) <= 3  # the steps of 4 and 5 rows (and the prefills) ran the layers


def test_where_the_program_cannot_run(gguf_models, hf_folders):
    llm = LLM(str(hf_folders["llama"]), dtype="float32")  # float weights
    assert "neither quantized nor packed" in llm.engine.runner.model.use_step_program()
    assert "step" not in llm.engine.runner.paths
    llm = LLM(str(gguf_models["Q8_0"]), dtype="float32", attention="torch-cascade")
    assert llm.engine.runner.paths["step"] == "Python between the kernels (attention is not on the CPU kernel)"
    llm = LLM(str(gguf_models["Q8_0"]), dtype="float32", ops="torch")
    assert llm.engine.runner.model.step_program is None and "step" not in llm.engine.runner.paths
    moe = LLM(str(gguf_models["Qwen3-MoE Q8_0"]), dtype="float32")  # its float32 router on oneDNN
    assert "neither quantized nor packed" in moe.engine.runner.model.use_step_program()
    floats = LLM(str(hf_folders["qwen3_moe"]), dtype="float32").engine.runner.model
    assert "not in one C call" in floats.use_step_program()


def test_a_failing_op_stops_the_program_and_says_which():
    """flock_run_program returns the first failing record (1-based); the records after it do not run."""
    ops = fused_ops.KERNEL.load(fused_ops.isa())
    attention = cpu.KERNEL.load(cpu.chosen_isa())
    bad = cpu._Args(num_heads=4, num_kv_heads=0, head_dim=64)  # a shape the kernel refuses
    x = torch.ones(2, 8)
    residual = torch.zeros(2, 8)
    norm = [program._address(ops.flock_add_rms_norm_op_f32), x.data_ptr(), 8, residual.data_ptr(), 8,
            torch.ones(8).data_ptr(), 2, 8, program._f32_word(1e-6), 1]
    cascade = [program._address(attention.flock_cpu_cascade_op), ctypes.addressof(bad), 0, 0]
    records = torch.tensor([r + [0] * (program.WIDTH - len(r)) for r in (norm, cascade, norm)], dtype=torch.int64)
    assert ops.flock_run_program(records.data_ptr(), 3, 2) == 2
    assert torch.equal(residual, torch.ones(2, 8))  # the first norm ran, the third did not


def test_the_step_rows_fill_the_rows_words():
    ops = fused_ops.KERNEL.load(fused_ops.isa())
    x, residual = torch.ones(3, 8), torch.zeros(3, 8)
    norm = [program._address(ops.flock_add_rms_norm_op_f32), x.data_ptr(), 8, residual.data_ptr(), 8,
            torch.ones(8).data_ptr(), program.ROWS, 8, program._f32_word(1e-6), 1]
    records = torch.tensor([norm + [0] * (program.WIDTH - len(norm))], dtype=torch.int64)
    assert ops.flock_run_program(records.data_ptr(), 1, 2) == 0
    assert torch.equal(residual, torch.tensor([[1.0] * 8] * 2 + [[0.0] * 8]))  # two rows added, not the third
    assert records[0, 6] == program.ROWS  # the records stay as they were


def test_the_embedding_op_refuses_ids_outside_its_table():
    ops = fused_ops.KERNEL.load(fused_ops.isa())
    table, out = torch.arange(12.0).view(4, 3), torch.zeros(2, 3)
    for ids, code in (([3, 1], 0), ([1, 4], 1), ([-1, 0], 1)):
        out.zero_()
        ids = torch.tensor(ids)
        args = torch.tensor([table.data_ptr(), 12, 4, ids.data_ptr(), 2, out.data_ptr(), 12, 12], dtype=torch.int64)
        assert ops.flock_embed_op(args.data_ptr()) == code
        assert torch.equal(out, table[ids] if code == 0 else torch.zeros(2, 3))  # all rows or none
