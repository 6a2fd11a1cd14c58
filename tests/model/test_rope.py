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
