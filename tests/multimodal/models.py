"""Random-weight vision-language models saved with their processors: a LLaVA (CLIP vision tower, MLP projector,
Llama text decoder; a chat template that places images), an Idefics3 (SigLIP-style tower, pixel-shuffle connector,
images split into tiles), Qwen2-VL, Qwen2.5-VL and Qwen3-VL (M-RoPE) and a Gemma 3 (images attended both ways); and
test images."""

import numpy as np
import torch
from PIL import Image

from flock.model.builtin import write_tokenizer
from tests.conftest import VOCAB

IMAGE_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def save_random(build, config, folder, seed: int, decoder: str) -> None:
    """`build(config)` with random weights, its decoder's (the parameters named with `decoder`) larger than the
    default init so that logits are far from ties, saved to `folder`."""
    torch.manual_seed(seed)
    model = build(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and decoder in name:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)


def make_llava(folder, seed: int = 0):
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=28, patch_size=7, projection_dim=32)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=VOCAB + 8, max_position_embeddings=256,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-2,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default")
    save_random(LlavaForConditionalGeneration, config, folder, seed, "language_model")
    images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=7, num_additional_image_tokens=1,
                   vision_feature_select_strategy="default", chat_template=IMAGE_TEMPLATE).save_pretrained(folder)
    return folder


def make_idefics3(folder, seed: int = 0):
    from transformers import (AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor, Idefics3VisionConfig, LlamaConfig)

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tiles = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<fake_token_around_image>",
                                                                "<global-img>", *tiles]})
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=32, patch_size=8)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=VOCAB + 64, max_position_embeddings=1024, pad_token_id=2)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    save_random(Idefics3ForConditionalGeneration, config, folder, seed, "text_model")
    images = Idefics3ImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                    do_image_splitting=True)
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4).save_pretrained(folder)
    return folder


QWEN_VL_TEMPLATE = IMAGE_TEMPLATE.replace("<image>\n", "<|vision_start|><|image_pad|><|vision_end|>")


def make_qwen_vl(folder, kind: str = "qwen2_5_vl", seed: int = 0, hub_layout: bool = False):
    """A Qwen2.5-VL (Qwen2-VL, Qwen3-VL) with M-RoPE sections of 2, 3 and 3 frequencies (Qwen3-VL's interleaved, its
    decoder a Qwen3 with DeepStack features from 2 vision blocks added to its first 2 layers' outputs), patches of 14
    (Qwen3-VL: 16) merged 2 x 2 and images resized to 4-16 merged patches; `hub_layout`: its config flat and its
    tensors named as the Qwen2(.5)-VL checkpoints published on the Hub are (the text decoder's fields at the top,
    `model.layers`, `visual`, the chat template in the processor's chat_template.json)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import (AutoConfig, AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil)

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    special = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    start, end, image, video = tokenizer.convert_tokens_to_ids(special)
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    tokenizer.save_pretrained(folder)
    patch = 16 if kind == "qwen3_vl" else 14
    common = dict(depth=2, num_heads=4, patch_size=patch, spatial_merge_size=2, temporal_patch_size=2)
    vision = {"qwen2_5_vl": dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56,
                                 fullatt_block_indexes=[1]),
              "qwen2_vl": dict(common, embed_dim=32, mlp_ratio=2, hidden_size=64),
              "qwen3_vl": dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                               num_position_embeddings=64, deepstack_visual_indexes=[0, 1])}[kind]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3 if kind == "qwen3_vl" else 2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB + 8,
                max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                rope_parameters=rope | {"mrope_interleaved": True} if kind == "qwen3_vl" else rope)
    config = AutoConfig.for_model(kind, vision_config=vision, text_config=text, vision_start_token_id=start,
                                  vision_end_token_id=end, image_token_id=image, video_token_id=video)
    save_random(AutoModelForImageTextToText.from_config, config, folder, seed, "language_model")
    unit = 2 * patch  # a merged patch's side in pixels
    processor = Qwen2VLImageProcessorPil(patch_size=patch, min_pixels=4 * unit * unit, max_pixels=16 * unit * unit)
    processor.save_pretrained(folder)
    saved = json.loads((folder / "preprocessor_config.json").read_text())
    saved["image_processor_type"] = "Qwen2VLImageProcessor"  # as published (torchvision's, else PIL's)
    (folder / "preprocessor_config.json").write_text(json.dumps(saved))
    if hub_layout:
        d = json.loads((folder / "config.json").read_text())
        flat = {k: v for k, v in d.pop("text_config").items() if k not in ("model_type", "rope_parameters")}
        rope = text["rope_parameters"]
        flat |= {"rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope[
            "mrope_section"]}}
        (folder / "config.json").write_text(json.dumps(d | flat))
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_VL_TEMPLATE}))
        (folder / "chat_template.jinja").unlink()
        renames = (("model.language_model.", "model."), ("model.visual.", "visual."))
        tensors = load_file(folder / "model.safetensors")
        save_file({next((new + k[len(old):] for old, new in renames if k.startswith(old)), k): v
                   for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


GEMMA3_TEMPLATE = IMAGE_TEMPLATE.replace("<image>\n", "<start_of_image>")


def make_gemma3(folder, seed: int = 0):
    """A Gemma 3 with images of 16 tokens (32 pixels, 4 x 4 patches of 8) that attend to each other both ways, and
    a sliding window of 8 on every other layer, shorter than an image."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil
    from transformers import Gemma3Processor

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, VOCAB)
    marks = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tokenizer = AutoTokenizer.from_pretrained(folder, extra_special_tokens=marks)
    boi, image, eoi = tokenizer.convert_tokens_to_ids(list(marks.values()))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=VOCAB + 8, max_position_embeddings=512,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, bos_token_id=None,
                eos_token_id=None, pad_token_id=None)
    config = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=16, boi_token_index=boi,
                          eoi_token_index=eoi, image_token_index=image)
    save_random(Gemma3ForConditionalGeneration, config, folder, seed, "language_model")
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=16,
                    chat_template=GEMMA3_TEMPLATE).save_pretrained(folder)
    return folder


def picture(seed: int, size=(40, 50)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype(np.uint8))
