"""Random-weight vision-language models saved with their processors: a LLaVA (CLIP vision tower, MLP projector,
Llama text decoder; a chat template that places images) and an Idefics3 (SigLIP-style tower, pixel-shuffle
connector, images split into tiles); and test images."""

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
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # larger weights than the default init, so logits are far from ties
        for name, p in model.named_parameters():
            if p.dim() > 1 and "language_model" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
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
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "text_model" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    images = Idefics3ImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                    do_image_splitting=True)
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4).save_pretrained(folder)
    return folder


def picture(seed: int, size=(40, 50)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype(np.uint8))
