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


def test_rope_kinds_flock_does_not_run_are_named_when_the_config_is_read():
    with pytest.raises(ValueError, match="rope scaling 'dynamic' is not supported"):
        ModelConfig.from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 1,
                               "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
