"""Image inputs of vision-language models (LLaVA's, Idefics3's, Qwen2-VL's, Gemma 3's): images read from URLs, files
or PIL, the model's own transformers processor placing their tokens in the prompt, and its vision tower and
projector turning them into the rows the text decoder reads in place of those tokens' embeddings (Qwen2-VL's also
set their tokens' rotary positions; Gemma 3's attend to their whole image)."""

from flock.multimodal.inputs import ImageInputs

__all__ = ["ImageInputs"]
