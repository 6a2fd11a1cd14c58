import math
from dataclasses import dataclass

import torch

from flock.model.config import ModelConfig


def inv_frequencies(config: ModelConfig, max_positions: int = 0) -> torch.Tensor:
    """The rotary frequencies of a model that runs up to `max_positions` positions."""
    dim = config.rotary_dim
    powers = config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / powers
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "dynamic":  # vLLM's: fixed frequencies, not transformers' recomputed per forward pass
        return _dynamic_ntk_inv_freq(config, scaling)
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "longrope":
        return 1.0 / (torch.tensor(_longrope_factors(scaling, max_positions), dtype=torch.float32) * powers)
    if kind == "yarn":
        return _yarn_inv_freq(powers, dim, config.rope_theta, scaling)
    raise NotImplementedError(f"rope scaling {kind!r} is not supported (supported: linear, dynamic, llama3, longrope, "
                              "yarn)")


def _dynamic_ntk_inv_freq(config: ModelConfig, s: dict) -> torch.Tensor:
    """Dynamic NTK's frequencies as vLLM fixes them: the base raised for the positions the model was trained on
    (`max_trained_positions`, by default max_position_embeddings: then the base as it is, which transformers also
    keeps up to that length; past it transformers recomputes the base for each pass's longest sequence, which would
    give a cached prefix other keys than a fresh one)."""
    dim, positions, factor = config.rotary_dim, config.max_position_embeddings, s["factor"]
    trained = s.get("max_trained_positions", positions)
    base = config.rope_theta * (factor * positions / trained - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def _yarn_inv_freq(powers: torch.Tensor, dim: int, base: float, s: dict) -> torch.Tensor:
    """YaRN's frequencies, as transformers computes them: the original ones for the fast dimensions, those
    interpolated by `factor` for the slow ones, a linear ramp between (dimensions turning beta_fast and beta_slow
    times over the original length, rounded outwards unless `truncate` is false)."""
    def dimension(rotations: float) -> float:
        return dim * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(s.get("beta_fast") or 32), dimension(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (s["factor"] * powers) * (1 - extrapolation) + 1.0 / powers * extrapolation


def _longrope_factors(s: dict, max_positions: int) -> list[float]:
    """LongRoPE's (Phi-3's) per-frequency factors: the long ones for every position when the model may run past
    its original length, else the short ones. transformers picks them per forward pass by its longest position,
    which would give a cached prefix other keys than a fresh one; vLLM picks them by max_model_len, as here."""
    return s["long_factor"] if max_positions > s["original_max_position_embeddings"] else s["short_factor"]


def attention_factor(config: ModelConfig) -> float:
    """The scale of LongRoPE's and YaRN's cos and sin tables (1 for the other kinds), as transformers computes it."""
    s = config.rope_scaling
    if s is None or s["rope_type"] not in ("longrope", "yarn"):
        return 1.0
    if s.get("attention_factor") is not None:
        return s["attention_factor"]
    factor = s["factor"]
    if factor <= 1.0:
        return 1.0
    if s["rope_type"] == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(s["original_max_position_embeddings"]))
    if s.get("mscale") and s.get("mscale_all_dim"):
        return _yarn_mscale(factor, s["mscale"]) / _yarn_mscale(factor, s["mscale_all_dim"])
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin computed in float32 and cast, as transformers does, so numerics match it."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_frequencies(config, max_positions))
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(config)
        cos, sin = on_one_thread(lambda: (emb.cos() * scale, emb.sin() * scale))
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)
        if config.mrope_section is not None:
            kinds = mrope_kinds(config.mrope_section, config.mrope_interleaved)
            self.register_buffer("mrope_kinds", torch.cat((kinds, kinds)), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return rotate_qk(self.cos, self.sin, positions, q, k)

    def rows(self, positions: torch.Tensor) -> "RopeRows":
        """M-RoPE's tables of one step's tokens, from their [3, tokens] time, height and width positions."""
        cos, sin = (table[positions].gather(0, self.mrope_kinds.expand(1, *positions.shape[1:], -1))[0]
                    for table in (self.cos, self.sin))
        return RopeRows(cos.contiguous(), sin.contiguous())


def mrope_kinds(sections: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """M-RoPE: the position (0 time, 1 height, 2 width) that turns each frequency, as transformers lays them out."""
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3) for i, n in enumerate(sections)])
    kinds = torch.zeros(sum(sections), dtype=torch.int64)
    kinds[1 : 3 * sections[1] : 3] = 1
    kinds[2 : 3 * sections[2] : 3] = 2
    return kinds


@dataclass
class RopeRows:
    """A rotary embedding's cos/sin rows made for one step (M-RoPE's): position i reads row i."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return rotate_qk(self.cos, self.sin, positions, q, k)


def rotate_qk(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def on_one_thread(fn):
    """fn() with PyTorch on one thread. On x86 torch's cos and sin are MKL's vector math, and when a process's first
    such call runs on several threads at once, MKL now and then gives one thread its low-accuracy AVX2 kernel
    (sCos_L9EP): the tables, and every greedy output after them, would then differ from process to process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.shape[-1] < x.shape[-1]:  # a partial rotary factor: the rest of each head passes as it is
        d = cos.shape[-1]
        return torch.cat((_rotate(x[..., :d], cos, sin), x[..., d:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
