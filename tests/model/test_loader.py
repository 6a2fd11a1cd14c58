"""Hugging Face folders in and out: sharded safetensors, clear errors, built-in models saved for others."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flock import LLM, SamplingParams
from flock.model import save_model
from flock.model.config import ModelConfig
from tests.conftest import make_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": [100, 200, 300]}]


def greedy(folder, **kw) -> list[list[int]]:
    llm = LLM(str(folder), dtype="float64", **kw)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_sharded_folder_loads_the_same_weights(tmp_path, hf_folders):
    sharded = make_hf_model("llama", tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert greedy(sharded) == greedy(hf_folders["llama"])


def _rewrite(folder, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    folder = make_hf_model("llama", tmp_path / "m")
    _rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        LLM(str(folder))


def test_mismatched_tensor_is_named(tmp_path):
    folder = make_hf_model("qwen2", tmp_path / "m")

    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

    _rewrite(folder, shrink)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(95, 64\), expected \(96, 64\)"):
        LLM(str(folder))


def test_unexpected_tensor_and_no_weights(tmp_path):
    folder = make_hf_model("llama", tmp_path / "m")
    _rewrite(folder, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mystery.weight'"):
        LLM(str(folder))
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(str(folder))
    assert greedy(folder, load_format="dummy")  # random weights from the config still work


def test_unknown_model_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="not a local folder, a GGUF file or a built-in model"):
        LLM("no/such-model")


def test_builtin_saved_as_hf_folder_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = save_model("flock/tiny", tmp_path / "tiny", dtype="float32")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(out)
    builtin = LLM("flock/tiny", dtype="float64")
    assert builtin.get_tokenizer().encode("hello world") == tok.encode("hello world")
    ids = torch.tensor([PROMPTS[0]["prompt_token_ids"]])
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    got = builtin.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got == expected
    assert greedy(out) == greedy("flock/tiny")  # the saved folder loads back with the same weights


def test_config_variants():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    c = ModelConfig.from_dict(base | {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0},
                                      "eos_token_id": [1, 2]})
    assert c.num_key_value_heads == 2 and c.head_dim == 4 and c.rope_theta == 5e5
    assert c.rope_scaling["rope_type"] == "linear" and c.eos_token_id == [1, 2]
    c = ModelConfig.from_dict(base | {"model_type": "qwen2", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert c.attention_bias and not c.o_proj_bias and c.rope_theta == 1e6 and c.rope_scaling is None
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelConfig.from_dict(base | {"model_type": "gpt2"})


def test_gemma_configs_read_as_transformers_reads_them():
    base = dict(vocab_size=10, hidden_size=16, intermediate_size=16, num_hidden_layers=8, num_attention_heads=2,
                head_dim=8)
    gemma = ModelConfig.from_dict(base | {"model_type": "gemma", "hidden_act": "gelu"})  # the legacy name: tanh
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.tie_word_embeddings and gemma.gemma_norms
    assert gemma.embedding_multiplier == 4.0 and not gemma.sandwich_norms and gemma.layer_windows == [None] * 8
    gemma2 = ModelConfig.from_dict(base | {"model_type": "gemma2"})  # Gemma2Config's defaults
    assert gemma2.layer_windows == [4096, None] * 4 and gemma2.attention_scale == 256**-0.5
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    gemma3 = ModelConfig.from_dict(base | {"model_type": "gemma3_text", "sliding_window": 512,
                                           "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma3.layer_windows == [512] * 5 + [None] + [512] * 2 and gemma3.qk_norm
    assert (gemma3.rope_theta, gemma3.local_rope_theta, gemma3.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert gemma3.attn_logit_softcapping is None and gemma3.final_logit_softcapping is None
    nested = ModelConfig.from_dict(base | {"model_type": "gemma3_text", "sliding_window_pattern": 2,
                                           "rope_parameters": {"full_attention": {"rope_type": "default",
                                                                                  "rope_theta": 5e5},
                                                               "sliding_attention": {"rope_theta": 2e4}}})
    assert nested.layer_windows == [4096, None] * 4 and (nested.rope_theta, nested.local_rope_theta) == (5e5, 2e4)
    assert nested.rope_scaling is None
    # gemma-3-4b-it's config: a sparse text_config that leans on Gemma3TextConfig's defaults
    outer = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
             "torch_dtype": "bfloat16", "vision_config": {"model_type": "siglip_vision_model"},
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                             "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024}}
    four = ModelConfig.from_dict(outer)
    assert four.multimodal and four.model_type == "gemma3_text" and four.eos_token_id == [1, 106]
    assert (four.num_attention_heads, four.num_key_value_heads, four.head_dim, four.vocab_size) == (8, 4, 256, 262_208)
    assert four.layer_windows[:6] == [1024] * 5 + [None] and four.torch_dtype == "bfloat16"
    with pytest.raises(ValueError, match="use_bidirectional_attention"):  # EmbeddingGemma's
        ModelConfig.from_dict(base | {"model_type": "gemma3_text", "use_bidirectional_attention": True})


def test_moe_configs_read_as_transformers_reads_them():
    base = dict(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2)
    mixtral = ModelConfig.from_dict(base | {"model_type": "mixtral"})  # MixtralConfig's defaults
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 32)
    assert mixtral.norm_topk_prob and mixtral.moe_layers == (True,) * 4 and mixtral.sliding_window is None
    qwen3 = ModelConfig.from_dict(base | {"model_type": "qwen3_moe", "num_experts": 16, "decoder_sparse_step": 2,
                                          "mlp_only_layers": [3], "moe_intermediate_size": 8})
    assert qwen3.moe_layers == (False, True, False, False) and qwen3.qk_norm and not qwen3.norm_topk_prob
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.shared_expert_intermediate_size) == (16, 8, 0)
    qwen2 = ModelConfig.from_dict(base | {"model_type": "qwen2_moe", "num_local_experts": 6})  # transformers 5's key
    assert (qwen2.num_experts, qwen2.num_experts_per_tok, qwen2.shared_expert_intermediate_size) == (6, 4, 5632)
    assert qwen2.attention_bias and not qwen2.o_proj_bias


def test_config_keys_read_as_transformers_reads_them(tmp_path):
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)
    assert ModelConfig.from_dict(base | {"model_type": "mistral"}).sliding_window == 4096  # MistralConfig's default
    assert ModelConfig.from_dict(base | {"model_type": "mistral", "sliding_window": None}).sliding_window is None
    qwen = base | {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8}
    assert ModelConfig.from_dict(qwen).sliding_window is None  # max_window_layers 28: no layer slides
    assert ModelConfig.from_dict(qwen | {"max_window_layers": 0}).sliding_window == 8
    assert ModelConfig.from_dict(qwen | {"max_window_layers": 1}).layer_windows == [None, 8]  # a backend each
    unsized = {k: v for k, v in qwen.items() if k != "sliding_window"} | {"max_window_layers": 0}
    assert ModelConfig.from_dict(unsized).sliding_window == 4096  # transformers' default for Qwen2 and Qwen3
    linear = ModelConfig.from_dict(base | {"max_position_embeddings": 64, "rope_scaling": {"rope_type": "linear",
                                                                                          "factor": 4.0}})
    assert linear.context_length == 256  # positions divided by the factor (vLLM's length too)
    moe = qwen | {"num_hidden_layers": 4, "max_window_layers": 4, "num_experts": 4, "num_experts_per_tok": 2}
    assert ModelConfig.from_dict(moe | {"model_type": "qwen3_moe"}).layer_windows == [8] * 4  # every layer
    assert ModelConfig.from_dict(moe | {"model_type": "qwen2_moe"}).layer_windows == [8, None, 8, None]
    assert ModelConfig.from_dict(base | {"model_type": "qwen2", "attention_bias": False}).attention_bias
    too_many = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5}  # a top 5 of 4 experts
    for unsupported, match in [({"hidden_act": "gelu"}, "hidden_act"), ({"mlp_bias": True}, "mlp_bias"),
                               (too_many, "num_experts_per_tok 5 of 4")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_dict(base | unsupported)
    (tmp_path / "config.json").write_text(json.dumps(base | {"eos_token_id": 3}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert ModelConfig.from_folder(tmp_path).eos_token_id == [3, 7]  # generate() stops at both


def test_built_in_models_are_kept_in_flock_cache_dir(tmp_path, monkeypatch):
    """What Flock writes once (a built-in model's folder, like its kernels) goes under FLOCK_CACHE_DIR."""
    from flock.model.builtin import materialize

    monkeypatch.setenv("FLOCK_CACHE_DIR", str(tmp_path))
    folder = materialize("flock/tiny")
    assert folder.is_relative_to(tmp_path) and (folder / "config.json").is_file()
