from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import xxhash

IMAGE_IDS = 1 << 31  # placeholders' prefix-cache ids start here, past every vocabulary


class ImageRows(NamedTuple):
    """A step's image inputs to the decoder: the rows of image placeholder tokens, the features that replace their
    embeddings, and their DeepStack rows (Qwen3-VL's: (layers, rows, hidden), added to the first layers' outputs)."""

    rows: torch.Tensor
    features: torch.Tensor
    deepstack: torch.Tensor | None = None


@dataclass(eq=False)
class ImageInputs:
    """A prompt's images as its model's processor made them: the tensors the vision encoder reads, the prompt
    positions of their placeholder tokens (in order: the encoder's feature rows go there one by one) and a hash
    of the pixels, which keeps prefix-cache blocks of different images apart. The engine fills `features`."""

    pixels: dict[str, torch.Tensor]
    positions: np.ndarray
    key: str
    features: torch.Tensor | None = None  # (len(positions), hidden): the decoder's input rows at those positions
    # Qwen3-VL's DeepStack: (layers, len(positions), hidden) rows added to those positions' outputs of its first layers
    deepstack: torch.Tensor | None = None
    # M-RoPE's (Qwen2-VL's): the prompt tokens' [3, prompt length] rotary positions, and index + rope_shift after it
    rope_positions: np.ndarray | None = None
    rope_shift: int = 0

    def cache_ids(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt with each placeholder token replaced by an id drawn from the pixels' hash and its place
        (in [2**31, 2**32): no vocabulary's), so that prefixes match up to the first image, and past it only
        where the pixels are the same."""
        ids = list(prompt_token_ids)  # a scheduler's prefix pseudo-request holds the first placeholders only
        for k, p in enumerate(self.positions[: np.searchsorted(self.positions, len(ids))].tolist()):
            ids[p] = IMAGE_IDS + xxhash.xxh3_64_intdigest(f"{self.key}\0{k}".encode()) % IMAGE_IDS
        return ids

    def rows_in(self, start: int, end: int) -> tuple[np.ndarray, slice]:
        """The placeholder positions in [start, end) and the slice of `features` that goes there."""
        lo, hi = np.searchsorted(self.positions, [start, end])
        return self.positions[lo:hi], slice(int(lo), int(hi))

    def rope_rows(self, start: int, end: int) -> np.ndarray:
        """M-RoPE's [3, end - start] positions of the sequence's tokens in [start, end)."""
        prompt = self.rope_positions
        out = np.arange(start, end) + self.rope_shift
        out = np.broadcast_to(out, (3, end - start)).copy()
        inside = max(0, min(end, prompt.shape[1]) - start)
        out[:, :inside] = prompt[:, start : start + inside]
        return out
