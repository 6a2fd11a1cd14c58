"""Prompts with images through the model's own transformers processor, which writes each image's placeholder
tokens (as many as the vision encoder gives it rows) into the prompt."""

import functools
import json
from pathlib import Path

import numpy as np
import xxhash

from flock.model.config import VISION_LANGUAGE_TYPES, ModelConfig
from flock.multimodal.images import load_image
from flock.multimodal.inputs import ImageInputs
from flock.multimodal.qwen_vl import QwenVLProcessor, mrope_positions

# what a processor returns besides the pixels
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
IMAGES_REFUSED = ("this model takes no images: it is a text-only model (or a folder without its image processor's "
                  "preprocessor_config.json)")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")  # without them a folder runs text alone
# chat content parts that carry an image: OpenAI's and vLLM's image_url, vLLM's image_pil, transformers' image
IMAGE_PARTS = ("image_url", "image_pil", "image")
# an image's text in a chat template that writes a content as text, by model type (vLLM's placeholders)
IMAGE_PLACEHOLDERS = {"llava": "<image>", "idefics3": "<image>", "smolvlm": "<image>", "gemma3": "<start_of_image>",
                      **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl"),
                                      "<|vision_start|><|image_pad|><|vision_end|>")}


class ImagePrompts:
    """A vision-language model's processor: a text prompt with its images becomes token ids and ImageInputs."""

    def __init__(self, folder: Path, config: ModelConfig, placeholder: str):
        from transformers import AutoProcessor

        self.placeholder = placeholder  # an image's text where a chat template writes contents as text
        self.mrope = config.mrope_section is not None  # its images also set their tokens' rotary positions
        self.bidirectional = config.bidirectional_images
        self.processor = QwenVLProcessor(folder) if self.mrope else AutoProcessor.from_pretrained(
            str(folder), local_files_only=True)
        self.image_token_id = config.image_token_id

    def encode_ids(self, ids: list[int], images: list) -> tuple[list[int], ImageInputs]:
        """vLLM's token prompt with images: `ids` hold each image's marker as the text prompt's tokens would (the
        chat template's, or the processor's image token); they are processed as the text they decode to, which
        must encode back to them (else ValueError: send the text)."""
        tokenizer = self.processor.tokenizer
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if tokenizer.encode(text, add_special_tokens=False) != list(ids):
            raise ValueError("prompt_token_ids with images must be the tokens of their text (these do not encode "
                             "back from it); send the text 'prompt'")
        return self.encode(text, images, add_special_tokens=False)

    def encode(self, text: str, images: list, add_special_tokens: bool = True,
               allow_files: bool = True) -> tuple[list[int], ImageInputs]:
        """Token ids and images of a prompt whose text marks each image where the processor expects it (its
        image token, or the chat template's), images as `flock.multimodal.images.load_image` reads them."""
        loaded = [load_image(image, allow_files) for image in images]
        try:
            out = self.processor(text=[text], images=loaded, return_tensors="pt",
                                 add_special_tokens=add_special_tokens)
        except Exception as e:  # processors raise ValueError, IndexError, ... (e.g. images and placeholders differ)
            raise ValueError(f"the model's processor refused the prompt's {len(loaded)} image(s): {e}") from None
        ids = out["input_ids"][0].tolist()
        pixels = {k: v for k, v in out.items() if k not in TEXT_KEYS}
        digest = xxhash.xxh3_128()
        for name in sorted(pixels):
            digest.update(name.encode())
            digest.update(pixels[name].contiguous().numpy().tobytes())
        positions = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        images = ImageInputs(pixels, positions, digest.hexdigest())
        if self.mrope:
            images.rope_positions, images.rope_shift = mrope_positions(len(ids), positions, pixels["image_grid_thw"],
                                                                       self.processor.merge_size)
        if self.bidirectional:
            images.spans = placeholder_runs(positions)
        return ids, images


@functools.cache
def image_prompts(folder: str) -> ImagePrompts | None:
    """The processor of the vision-language model in `folder`, or None for a model that takes no images."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        return None
    d = json.loads(config.read_text())
    if d.get("model_type") not in VISION_LANGUAGE_TYPES or not any(
            (Path(folder) / name).is_file() for name in PROCESSOR_FILES):
        return None
    return ImagePrompts(Path(folder), ModelConfig.from_dict(d), IMAGE_PLACEHOLDERS[d["model_type"]])


def split_images(content: list) -> tuple[list[dict], list]:
    """A chat message's content parts in transformers' form (each image a {"type": "image"} part) and its
    images' sources in order; text parts as they are."""
    parts, sources = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in IMAGE_PARTS:
            parts.append(part)
            continue
        source = part.get(kind, part.get("url", part.get("path")))
        if isinstance(source, dict):  # OpenAI's {"url": ..., "detail": ...}
            source = source.get("url")
        if source is None:
            raise ValueError(f"a content part of type {kind!r} needs its image (as '{kind}')")
        parts.append({"type": "image"})
        sources.append(source)
    return parts, sources


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in m["content"]) for m in messages)


def placeholder_runs(positions: np.ndarray) -> np.ndarray:
    """[images, 2] first and end (exclusive) positions of each run of consecutive placeholder tokens (an image)."""
    if not len(positions):
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    return np.array([[run[0], run[-1] + 1] for run in np.split(positions, breaks)], dtype=np.int64)
