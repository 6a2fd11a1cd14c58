from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flock.sampling_params import SamplingParams


@dataclass
class PoolingParams:
    """How an embedding request turns its prompt into a vector, as vLLM's `PoolingParams` for a decoder model's
    embeddings (Qwen3-Embedding, e5-mistral): the final hidden state of the prompt's last token (it has seen the
    whole prompt, so a shared prefix's KV serves every prompt that starts with it), its first `dimensions` values
    (a Matryoshka model's shorter embeddings), L2-normalized unless `normalize` is False."""

    dimensions: int | None = None
    normalize: bool = True
    truncate_prompt_tokens: int | None = None  # as SamplingParams': keep this many prompt tokens (-1: the limit)

    def validate(self, hidden_size: int) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= hidden_size):
            raise ValueError(f"dimensions must be an integer in [1, {hidden_size}] (the model's hidden size), "
                             f"got {d!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")

    def as_sampling(self) -> SamplingParams:
        """The engine request that computes the prompt (and samples nothing: the runner pools its last row)."""
        return SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=self.truncate_prompt_tokens)

    def pool(self, hidden: torch.Tensor) -> list[float]:
        """The embedding of a last token's final hidden state, in float32 (float64 models: float64)."""
        x = hidden[: self.dimensions].to(torch.promote_types(hidden.dtype, torch.float32))
        return (F.normalize(x, dim=0) if self.normalize else x).tolist()


def pair_scores(left: list[list[float]], right: list[list[float]]) -> list[float]:
    """vLLM's score of an embedding model (a bi-encoder): each pair's cosine similarity, in float64; one vector on
    the left is scored against every one on the right, else they pair up in order."""
    a, b = (F.normalize(torch.tensor(v, dtype=torch.float64), dim=1) for v in (left, right))
    return (b @ a[0] if len(a) == 1 else (a * b).sum(1)).tolist()
