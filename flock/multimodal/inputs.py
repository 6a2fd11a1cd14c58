from dataclasses import dataclass

import numpy as np
import torch
import xxhash

IMAGE_IDS = 1 << 31  # placeholders' prefix-cache ids start here, past every vocabulary


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
    # Gemma 3's: [images, 2] first and end positions of each image, whose tokens attend to each other both ways:
    # a step never ends inside one (all of its tokens' K and V are there when any of them attends)
    spans: np.ndarray | None = None

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

    def fit_chunk(self, start: int, n: int) -> int:
        """The length of a chunk from `start` of about n tokens that ends outside every image: cut before the
        image it would end inside, or (starting in or at it) stretched to the image's end."""
        end = start + n
        inside = self.spans[(self.spans[:, 0] < end) & (end < self.spans[:, 1])]
        if not len(inside):
            return n
        first, stop = inside[0]
        return int(first - start if first > start else stop - start)

    def prefix_end(self, length: int) -> int:
        """The longest prefix of at most `length` tokens that ends outside every image."""
        inside = self.spans[(self.spans[:, 0] < length) & (length < self.spans[:, 1])]
        return int(inside[0, 0]) if len(inside) else length

    def attend_ends(self, positions: np.ndarray) -> np.ndarray:
        """The last position each of `positions` attends: its image's last for an image token, else its own."""
        ends = positions.copy()
        for first, stop in self.spans.tolist():
            ends[(positions >= first) & (positions < stop)] = stop - 1
        return ends
