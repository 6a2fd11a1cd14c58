"""A vision-language model's vision tower and projector, as transformers runs them, loaded without its text
decoder (Flock's own model runs that)."""

import inspect
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from flock.model import gemm, linear
from flock.multimodal.inputs import ImageInputs

CACHED_IMAGES = 64  # prompts' features kept by pixel hash: a batch asking many questions of one image encodes it once
TEXT_MODULES = ("model.language_model.", "model.text_model.", "lm_head.")


class VisionEncoder:
    """Turns a prompt's images into the rows its placeholder tokens take in the decoder's input."""

    def __init__(self, folder: Path, dtype: torch.dtype, device: torch.device, load_format: str, seed: int,
                 ops: str = "auto"):
        from transformers import AutoConfig, AutoModelForImageTextToText
        from transformers.utils import logging

        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        # the text decoder shrunk to nothing: transformers builds and loads only the vision side
        text = config.text_config
        deepstack = getattr(config.vision_config, "deepstack_visual_indexes", ())
        if len(deepstack) >= text.num_hidden_layers:  # the decoder adds them to the outputs of all but its last
            raise ValueError(f"{folder}: {len(deepstack)} DeepStack feature layers for a decoder of "
                             f"{text.num_hidden_layers} layers")
        text.num_hidden_layers, text.vocab_size, text.pad_token_id = 0, 1, None
        for key in ("quantization_config", "compression_config"):  # the decoder's (flock.model.hf_quant)
            config.__dict__.pop(key, None)
        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()
        try:
            if load_format == "dummy":
                torch.manual_seed(seed)
                model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
            else:
                model, info = AutoModelForImageTextToText.from_pretrained(
                    str(folder), config=config, dtype=dtype, ignore_mismatched_sizes=True, local_files_only=True,
                    output_loading_info=True)
                missing = [k for k in info["missing_keys"] if not k.startswith(TEXT_MODULES)]
                if missing:
                    raise ValueError(f"{folder}: the vision tower's tensor {missing[0]!r} is missing"
                                     + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        finally:
            logging.set_verbosity(verbosity)
        self.model = model.model.to(device).eval()
        if ops in ("auto", "packed"):
            pack_linears(self.model, dtype, device)
        self.takes = set(inspect.signature(self.model.get_image_features).parameters)
        self.dtype, self.device = dtype, device
        self.cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor | None]] = OrderedDict()

    @torch.inference_mode()
    def encode(self, images: ImageInputs) -> None:
        """Set `images.features` and `images.deepstack` (from the cache when the same pixels came before);
        ValueError when the prompt has not one placeholder token for each feature row."""
        cached = self.cache.get(images.key)
        if cached is None:
            pixels = {k: v.to(self.device, self.dtype if v.is_floating_point() else v.dtype)
                      for k, v in images.pixels.items() if k in self.takes}
            out = self.model.get_image_features(**pixels)
            deepstack = getattr(out, "deepstack_features", None)  # Qwen3-VL's, per layer a tuple per image
            cached = rows(out.pooler_output), None if deepstack is None else torch.stack([rows(d) for d in deepstack])
            self.cache[images.key] = cached
            while len(self.cache) > CACHED_IMAGES:
                self.cache.popitem(last=False)
        self.cache.move_to_end(images.key)
        features = cached[0]
        if len(features) != len(images.positions):
            raise ValueError(f"the prompt has {len(images.positions)} image placeholder tokens for "
                             f"{len(features)} image feature rows (were its placeholders edited?)")
        images.features, images.deepstack = cached


def rows(per_image) -> torch.Tensor:
    """Each image's feature rows, one after the other."""
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in per_image])


def pack_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Run the vision side's projections on the GEMMs the decoder's run on (Flock's bf16 GEMM, else oneDNN's
    prepacked weights; see flock.model.linear), where this CPU and dtype have them."""
    pairs = gemm.unavailable(dtype, device) is None
    if not pairs and linear.unavailable(dtype, device) is not None:
        return
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = linear.Linear
            module.prepack(pairs=pairs)
