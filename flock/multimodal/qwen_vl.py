"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's image prompts: each image token expanded to the rows its merged patches
give, and M-RoPE's time, height and width positions of every prompt token."""

from pathlib import Path

import numpy as np
import torch


class QwenVLProcessor:
    """transformers' Qwen2VLProcessor for images alone: its image processor makes the patches and their grid, and
    each image token of the text becomes one token per merged patch (transformers' processor also builds a video
    processor, which needs torchvision)."""

    def __init__(self, folder: Path):
        from transformers import AutoImageProcessor, AutoTokenizer
        from transformers.utils import logging

        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()  # its warning that the PIL image processor stands in for torchvision's
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
        finally:
            logging.set_verbosity(verbosity)
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        self.merge_size = self.image_processor.merge_size

    def __call__(self, text: list[str], images: list, return_tensors: str = "pt",
                 add_special_tokens: bool = True) -> dict[str, torch.Tensor]:
        pieces = text[0].split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} image tokens {self.image_token!r} for "
                             f"{len(images)} images")
        pixels = dict(self.image_processor(images=images, return_tensors=return_tensors)) if images else {}
        counts = [int(n) // self.merge_size**2 for n in pixels["image_grid_thw"].prod(-1)] if images else []
        expanded = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        return {"input_ids": torch.tensor([ids]), **pixels}


def mrope_positions(num_tokens: int, placeholders: np.ndarray, grids: torch.Tensor,
                    merge_size: int) -> tuple[np.ndarray, int]:
    """The [3, num_tokens] positions of a prompt whose images' placeholder tokens (one per merged patch, each image's
    in a run) lie at `placeholders`, and the shift of the tokens after it (position = index + shift), as
    transformers' get_rope_index makes them: text tokens count on from the last position on all three; an image's
    tokens take the next position plus their time, row and column in its grid of merged patches, and the text
    after it goes on past the image's larger side."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    text_start, next_position, first = 0, 0, 0
    for t, h, w in grids.tolist():
        h, w = h // merge_size, w // merge_size
        n = t * h * w
        start = int(placeholders[first]) if first < len(placeholders) else num_tokens
        if first + n > len(placeholders) or placeholders[first + n - 1] != start + n - 1:
            raise ValueError(f"the prompt's image placeholder tokens do not make one run of {n} for each image")
        out[:, text_start:start] = np.arange(start - text_start) + next_position
        next_position += start - text_start
        grid = np.indices((t, h, w)).reshape(3, -1)
        out[:, start : start + n] = grid + next_position
        next_position += max(h, w)
        text_start, first = start + n, first + n
    if first != len(placeholders):
        raise ValueError(f"the prompt has {len(placeholders)} image placeholder tokens for {first} image rows")
    out[:, text_start:] = np.arange(num_tokens - text_start) + next_position
    return out, next_position - text_start
