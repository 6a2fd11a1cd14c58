import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(min(2, os.cpu_count() or 1))

from flock import native  # noqa: E402
from flock.engine import runner  # noqa: E402
from flock.model.builtin import write_tokenizer  # noqa: E402

VOCAB = 8192

HF_CONFIGS = {
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
    ),
    "llama3": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    ),
    "qwen2_yarn": dict(  # Qwen2.5's long-context YaRN: 4 x an original 64 positions (transformers' default betas)
        model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "qwen3": dict(  # heads wider than hidden_size / heads, as Qwen3's
        model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
    ),
    "llama256": dict(  # rows of 256: K-quants fit
        model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
    ),
    "phi3": dict(  # fused qkv and gate_up tensors, a sliding window
        model_type="phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=20,
    ),
    "phi3_longrope": dict(  # Phi-3-128k's LongRoPE: the long factors, as max_model_len passes the original 64
        model_type="phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                      "long_factor": [1.0 + i for i in range(8)]},
    ),
    "phi3_partial": dict(  # Phi-4-mini's partial rotary factor: the rope turns the first 12 of 16 dims a head
        model_type="phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, partial_rotary_factor=0.75,
    ),
    "granite": dict(  # Granite's multipliers of the embeddings, residual adds, attention scores and logits
        model_type="granite", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, embedding_multiplier=3.0,
        residual_multiplier=0.5, logits_scaling=2.5, attention_multiplier=0.09,
    ),
    "gemma": dict(  # GeGLU, norms offset from 1, embeddings scaled by sqrt(hidden_size)
        model_type="gemma", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
    ),
    "gemma2": dict(  # four norms a layer, windows on every other layer, capped scores and logits
        model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, query_pre_attn_scalar=24,
        sliding_window=12, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
    ),
    "gemma3": dict(  # q/k norms; windowed layers on their own unscaled rope base, the global ones scaled
        model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, query_pre_attn_scalar=32,
        sliding_window=10, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                        "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    ),
    "qwen3_moe": dict(  # 8 experts, the top 2 renormalized
        model_type="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, norm_topk_prob=True,
    ),
    "qwen3_moe_dense": dict(  # layers 1 and 2 dense MLPs (mlp_only_layers, decoder_sparse_step), which GGUF lacks
        model_type="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[3],
    ),
    "qwen2_moe": dict(  # 4 experts, the top 2 as the softmax gives them, a gated shared expert; qkv bias
        model_type="qwen2_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=96,
    ),
    "mixtral": dict(  # w1/w2/w3 experts under block_sparse_moe
        model_type="mixtral", hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
    ),
    "smollm3": dict(  # no rotary embedding on every 4th layer (NoPE)
        model_type="smollm3", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    ),
    "mistral": dict(
        model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, sliding_window=12,
    ),
}


def make_hf_model(kind: str, folder, seed: int = 0, vocab: int = VOCAB, **save_kwargs):
    """A random-weight transformers model saved as a Hugging Face folder with the built-in tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(HF_CONFIGS[kind])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, vocab_size=vocab, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so logits are far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            else:  # norms and biases
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder, **save_kwargs)
    write_tokenizer(folder, vocab)
    return folder


def pytest_sessionstart(session):
    """Every path of every kernel the suite builds (AMX ones and emulations too), compiled side by side first."""
    native.prebuild((lib, path) for lib in native.DECLARED for path in lib.paths)


@pytest.fixture(scope="session", autouse=True)
def cpu_unless_named():
    """device="auto" is the CPU in tests, also on a CUDA machine: the suite tests the CPU paths, and the GPU
    tests (tests/engine/test_cuda.py, tests/attention/test_triton.py) name cuda."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "resolve_device", lambda name: torch.device("cpu" if name == "auto" else name))
        yield


@pytest.fixture(scope="session")
def thinker(tmp_path_factory):
    """A random Llama of two more tokens, its tokenizer's two reserved ones (ids VOCAB, VOCAB + 1) renamed <think>
    and </think>."""
    folder = make_hf_model("llama", tmp_path_factory.mktemp("thinker"), vocab=VOCAB + 2)
    tok = json.loads((folder / "tokenizer.json").read_text())
    names = {VOCAB: "<think>", VOCAB + 1: "</think>"}
    for added in tok["added_tokens"]:
        added["content"] = names.get(added["id"], added["content"])
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: make_hf_model(kind, root / kind) for kind in HF_CONFIGS}


@pytest.fixture(scope="session")
def llava_folder(tmp_path_factory):
    from tests.multimodal.models import make_llava

    return make_llava(tmp_path_factory.mktemp("llava") / "llava")


@pytest.fixture(scope="session")
def idefics3_folder(tmp_path_factory):
    from tests.multimodal.models import make_idefics3

    return make_idefics3(tmp_path_factory.mktemp("idefics3") / "idefics3")
