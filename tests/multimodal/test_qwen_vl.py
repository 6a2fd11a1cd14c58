"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: each image resized to its own grid of patches, and M-RoPE (an image's tokens
turned by their time, row and column; the text after it counting on past its larger side; Qwen3-VL's frequencies
interleaved, and its DeepStack features added to the first layers' outputs). Greedy tokens equal transformers' under
every scheduler, with prompts cut into chunks and preempted, in float32 and float64; the positions equal
transformers' get_rope_index; Qwen2(.5)-VL checkpoints as published (a flat config, `model.layers` and `visual`
tensors) load."""

import base64
import io

import numpy as np
import pytest
import torch

from flock import LLM, SamplingParams
from flock.multimodal.processor import image_prompts
from flock.multimodal.qwen_vl import mrope_positions
from tests.multimodal.models import make_qwen_vl, picture

NEW = 8
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
SYSTEM = {"role": "system", "content": "You answer questions about pictures in a few plain words, nothing else."}
QUESTIONS = ["What is this?", "Describe the colors."]
SIZES = [(60, 90), (100, 40), (40, 50)]  # grids of 2 x 3, 4 x 2 and 2 x 2 merged patches: rows and columns differ
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TWO_IMAGES = f"Compare {IMAGE} with {IMAGE} please:"


def chat(image, question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": question}]}]


def conversations() -> list[list[dict]]:
    return [chat(picture(seed, size), q) for seed, size in enumerate(SIZES) for q in QUESTIONS]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def folder(request, tmp_path_factory):
    return make_qwen_vl(tmp_path_factory.mktemp(request.param) / request.param, request.param)


def transformers_greedy(folder, prompts: list[tuple[str, list]], dtype=torch.float32) -> list[list[int]]:
    """transformers' greedy tokens of (text, images) prompts, from the token ids and pixels Flock's processor
    makes (transformers' own processor needs torchvision; its model checks the image tokens' count)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype)
    out = []
    for text, images in prompts:
        ids, inputs = image_prompts(str(folder)).encode(text, images, add_special_tokens=False)
        input_ids = torch.tensor([ids])
        generated = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                   mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
                                   **inputs.pixels, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        out.append(generated[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' tokens for 3 images x 2 questions (chat), and for a prompt with two images."""
    llm = LLM(str(folder), load_format="dummy")  # only its tokenizer's chat template
    texts = [llm.engine.tokenizer.apply_chat_template(
        [SYSTEM, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}], tokenize=False,
        add_generation_prompt=True) for q in QUESTIONS]
    prompts = [(texts[i % 2], [picture(i // 2, SIZES[i // 2])]) for i in range(6)]
    prompts.append((TWO_IMAGES, [picture(0), picture(5, (60, 30))]))
    tokens = transformers_greedy(folder, prompts)
    return tokens[:6], tokens[6]


@pytest.mark.parametrize("engine", [
    dict(scheduler="fcfs"), dict(scheduler="batchllm"), dict(scheduler="feather"), dict(scheduler="lpm"),
    dict(scheduler="fcfs", max_num_batched_tokens=8, enable_chunked_prefill=True),  # images cut across chunks
    dict(scheduler="fcfs", num_kv_blocks=20, block_size=4),  # preempted and recomputed
    dict(scheduler="fcfs", ops="torch"),
])
def test_greedy_tokens_equal_transformers(folder, reference, engine):
    chats, two = reference
    llm = LLM(str(folder), dtype="float32", **engine)
    assert [o.outputs[0].token_ids for o in llm.chat(conversations(), PARAMS, use_tqdm=False)] == chats
    prompt = {"prompt": TWO_IMAGES, "multi_modal_data": {"image": [picture(0), picture(5, (60, 30))]}}
    assert llm.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == two


def test_token_id_prompts_with_images_equal_transformers(folder, reference):
    llm = LLM(str(folder), dtype="float32")
    prompt = {"prompt_token_ids": llm.get_tokenizer()(TWO_IMAGES)["input_ids"],
              "multi_modal_data": {"image": [picture(0), picture(5, (60, 30))]}}
    assert llm.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == reference[1]


def test_float64_and_text_alone_equal_transformers(folder):
    """In float64; and a prompt without images, whose three positions are its tokens' (plain RoPE)."""
    images = [picture(3, (90, 60)), picture(4)]
    text = f"{IMAGE} first, then {IMAGE}"
    want = transformers_greedy(folder, [(text, images)], torch.float64)
    llm = LLM(str(folder), dtype="float64")
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, PARAMS, use_tqdm=False)
    assert out[0].outputs[0].token_ids == want[0]

    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64)
    ids = llm.engine.tokenizer.encode("Only words here, no pictures at all.")
    plain = model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert llm.generate([ids], PARAMS, use_tqdm=False)[0].outputs[0].token_ids == plain[0, len(ids):].tolist()


def test_positions_equal_get_rope_index(folder):
    """Images first, between text and last, of several sizes: the same [3, tokens] positions and shift."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).model
    prompts = image_prompts(str(folder))
    for text, sizes in [(f"{IMAGE} a", [(60, 90)]), (f"a {IMAGE} b {IMAGE}{IMAGE} c", [(100, 40), (40, 50), (56, 56)]),
                        (f"words then {IMAGE}", [(200, 30)])]:
        ids, inputs = prompts.encode(text, [picture(i, size) for i, size in enumerate(sizes)])
        input_ids = torch.tensor([ids])
        want, delta = model.get_rope_index(input_ids, (input_ids == model.config.image_token_id).int(),
                                           image_grid_thw=inputs.pixels["image_grid_thw"])
        np.testing.assert_array_equal(inputs.rope_positions, want[:, 0].numpy())
        assert inputs.rope_shift == int(delta)
        np.testing.assert_array_equal(inputs.rope_rows(len(ids) - 2, len(ids) + 3),
                                      np.concatenate([want[:, 0, -2:].numpy(), np.tile(np.arange(len(ids), len(ids) + 3)
                                                                                       + int(delta), (3, 1))], 1))


def test_published_checkpoint_layout_loads(folder, tmp_path):
    """A flat config (the decoder's fields at the top, rope_scaling {"type": "mrope"}), `model.layers` and `visual`
    tensor names and the chat template in chat_template.json give the same tokens as transformers 5's layout."""
    kind = folder.name
    if kind == "qwen3_vl":
        pytest.skip("Qwen3-VL's checkpoints are published in transformers 5's layout")
    hub = make_qwen_vl(tmp_path / kind, kind, hub_layout=True)
    got = [[o.outputs[0].token_ids for o in LLM(str(f), dtype="float32").chat(conversations()[:2], PARAMS,
                                                                               use_tqdm=False)] for f in (folder, hub)]
    assert got[0] == got[1]


def test_bfloat16_runs_images(folder, reference):
    llm = LLM(str(folder), dtype="bfloat16")
    out = llm.chat(conversations()[0], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == NEW and out[0] == reference[0][0][0]


def test_blocks_are_shared_for_the_same_image(folder):
    llm = LLM(str(folder), dtype="float32", block_size=4, scheduler="batchllm")
    data_url = "data:image/png;base64," + base64.b64encode(_png(picture(0, SIZES[0]))).decode()
    same = [[SYSTEM, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                                  {"type": "text", "text": q}]}] for q in QUESTIONS]
    got = [o.outputs[0].token_ids for o in llm.chat(same, PARAMS, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in llm.chat(conversations()[:2], PARAMS, use_tqdm=False)]
    assert llm.stats()["cached_prefill_tokens"] >= 6  # the second question read the system prompt and 6 image rows


def test_beam_search_with_images_equals_the_same_search_on_transformers(folder):
    """vLLM's beam search over a prompt with images: each step's beams carry the images (and their positions)."""
    from transformers import AutoModelForImageTextToText

    from flock.beam_search import BeamSearch, BeamSearchParams
    from flock.sample.logprobs import TokenLogprobs

    images = [picture(0), picture(5, (60, 30))]
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    llm = LLM(str(folder), dtype="float64", block_size=4)
    got = llm.beam_search({"prompt": TWO_IMAGES, "multi_modal_data": {"image": images}}, params)[0].sequences
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64)
    prompt, inputs = image_prompts(str(folder)).encode(TWO_IMAGES, images)
    search = BeamSearch(prompt, params, [])
    with torch.no_grad():
        while not search.done:
            entries = []
            for tokens, _ in search.requests():
                ids = torch.tensor([tokens])
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs.pixels,
                               mm_token_type_ids=(ids == model.config.image_token_id).int()).logits
                top = logits[0, -1].log_softmax(-1).topk(4)
                entries.append(TokenLogprobs(int(top.indices[0]), float(top.values[0]), 1,
                                             list(zip(top.indices.tolist(), top.values.tolist()))))
            search.advance(entries)
    want = search.result()
    assert [b.tokens for b in got] == [b.tokens for b in want]
    assert [b.cum_logprob for b in got] == pytest.approx([b.cum_logprob for b in want], abs=1e-9)


def test_images_and_placeholders_must_agree(folder):
    llm = LLM(str(folder), load_format="dummy")
    with pytest.raises(ValueError, match=r"request 0: .*the prompt has 1 image tokens '<\|image_pad\|>' for 2 images"):
        llm.generate({"prompt": f"{IMAGE} twice?", "multi_modal_data": {"image": [picture(0), picture(1)]}})
    ids, inputs = image_prompts(str(folder)).encode(f"x {IMAGE} y", [picture(0)])
    with pytest.raises(ValueError, match="one run of 6"):
        mrope_positions(len(ids), inputs.positions[1:], inputs.pixels["image_grid_thw"], 2)


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
