import pytest
import torch

from flock.model.config import ModelConfig
from flock.model.rope import RotaryEmbedding, inv_frequencies, on_one_thread


def test_on_one_thread_runs_on_one_thread_and_restores_the_count():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert on_one_thread(torch.get_num_threads) == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(ZeroDivisionError):
            on_one_thread(lambda: 1 / 0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_are_float32_cos_and_sin_cast(dtype):
    """The tables transformers computes (float32 cos and sin of position x frequency, then cast)."""
    config = ModelConfig(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=64, rope_theta=1e5)
    rope = RotaryEmbedding(config, 3000, dtype)
    angles = torch.arange(3000, dtype=torch.float64)[:, None] * inv_frequencies(config).double()
    angles = torch.cat((angles, angles), dim=-1).float()
    assert torch.equal(rope.cos, angles.cos().to(dtype)) and torch.equal(rope.sin, angles.sin().to(dtype))


@pytest.mark.parametrize("scaling", [
    {"factor": 4.0, "original_max_position_embeddings": 64},
    {"factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
    {"factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 1.3},
])
def test_yarn_frequencies_and_scale_are_transformers(scaling):
    """YaRN's interpolated frequencies, ramp and cos / sin scale, as transformers computes them."""
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from flock.model.rope import attention_factor

    spec = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, rope_theta=1e6,
                max_position_embeddings=int(scaling["factor"] * scaling["original_max_position_embeddings"]))
    theirs = Qwen2Config(**spec, rope_scaling={"rope_type": "yarn", **scaling})
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    ours = ModelConfig.from_dict({"model_type": "qwen2", "vocab_size": 10, "intermediate_size": 8,
                                  "num_hidden_layers": 1, **spec, "rope_scaling": {"rope_type": "yarn", **scaling}})
    assert torch.equal(inv_frequencies(ours), inv_freq) and attention_factor(ours) == pytest.approx(scale, rel=1e-12)
    assert ours.context_length == spec["max_position_embeddings"]


LLAMA = {"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 1, "max_position_embeddings": 256}


def test_rope_kinds_flock_does_not_run_are_named_when_the_config_is_read():
    for scaling, message in (({"rope_type": "xpos", "factor": 2.0}, "rope scaling 'xpos' is not supported"),
                             ({"rope_type": "dynamic", "alpha": 1000.0}, "'alpha'")):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict(LLAMA | {"rope_scaling": scaling})


def test_dynamic_ntk_frequencies_are_vllms():
    """vLLM's fixed dynamic NTK: the base as it is (transformers' too, up to max_position_embeddings) unless
    max_trained_positions is shorter; the context stretched by the factor."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = ModelConfig.from_dict(LLAMA | {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    theirs = LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"},
                         rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    assert torch.equal(inv_frequencies(config), ROPE_INIT_FUNCTIONS["dynamic"](theirs, "cpu", seq_len=256)[0])
    assert config.context_length == 1024
    trained = ModelConfig.from_dict(LLAMA | {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0,
                                                              "max_trained_positions": 128}})
    base = 10000.0 * (4.0 * 256 / 128 - 3.0) ** (64 / 62)
    assert torch.allclose(inv_frequencies(trained), 1.0 / base ** (torch.arange(0, 64, 2).float() / 64))


def test_llama3_scaling_without_its_original_length_takes_the_positions():
    """As transformers fills it in: original_max_position_embeddings is max_position_embeddings."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = ModelConfig.from_dict(LLAMA | {"rope_scaling": dict(scaling)})
    theirs = LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"}, rope_scaling=scaling)
    assert config.rope_scaling["original_max_position_embeddings"] == 256
    assert torch.equal(inv_frequencies(config), ROPE_INIT_FUNCTIONS["llama3"](theirs, "cpu")[0])
