"""Gemma 3's images: an image's tokens attend to each other both ways (its later tokens too), to the text before
them within the sliding window, and the text after them causally. Greedy tokens equal transformers' under every
scheduler and attention backend, with their logprobs (which the mask moves by up to 0.3 here, where greedy tokens may
not change), with steps shorter than an image (a step never ends inside one: it stretches to the image's end or
stops before it), preempted, in float32, float64 and bfloat16; BatchLLM's group prefixes never end inside an
image."""

import numpy as np
import pytest
import torch

from flock import LLM, SamplingParams
from flock.multimodal.processor import image_prompts
from tests.multimodal.models import make_gemma3, picture

NEW = 8
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
SYSTEM = {"role": "system", "content": "You answer questions about pictures in a few plain words, nothing else."}
QUESTIONS = ["What is this?", "Describe the colors."]
TWO_IMAGES = "Compare <start_of_image> with <start_of_image> please:"


def chat(image, question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": question}]}]


def conversations() -> list[list[dict]]:
    return [chat(picture(seed), q) for seed in range(3) for q in QUESTIONS]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_gemma3(tmp_path_factory.mktemp("gemma3") / "gemma3")


def transformers_greedy(folder, prompts: list[tuple[str, list, bool]], dtype=torch.float32):
    """Each (text, images, add special tokens) prompt's greedy tokens and their logprobs."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=dtype)
    out = []
    for text, images, special in prompts:
        inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=special)
        generated = model.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True)
        tokens = generated.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        logprobs = [float(s[0].double().log_softmax(-1)[t]) for s, t in zip(generated.logits, tokens)]
        out.append((tokens, logprobs))
    return out


def answers(outputs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs]


def assert_same(got, want, tolerance: float) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=tolerance)


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' tokens for 3 images x 2 questions (chat), and for a prompt with two images."""
    tokenizer = LLM(str(folder), load_format="dummy").engine.tokenizer
    texts = [tokenizer.apply_chat_template([SYSTEM, {"role": "user", "content": [{"type": "image"}, {
        "type": "text", "text": q}]}], tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    prompts = [(texts[i % 2], [picture(i // 2)], False) for i in range(6)]
    prompts.append((TWO_IMAGES, [picture(0), picture(5, (60, 30))], True))
    tokens = transformers_greedy(folder, prompts)
    return tokens[:6], tokens[6]


@pytest.mark.parametrize("engine", [
    dict(scheduler="fcfs"), dict(scheduler="batchllm"), dict(scheduler="feather"), dict(scheduler="lpm"),
    dict(scheduler="fcfs", max_num_batched_tokens=8, enable_chunked_prefill=True),  # images longer than a step
    dict(scheduler="batchllm", max_num_batched_tokens=8, enable_chunked_prefill=True, block_size=4),
    dict(scheduler="batchllm", enable_prefix_caching=False, block_size=4),  # group prefixes of whole blocks
    dict(scheduler="fcfs", num_kv_blocks=24, block_size=4),  # preempted and recomputed
    dict(scheduler="fcfs", attention="torch"), dict(scheduler="batchllm", attention="torch-cascade"),
    dict(scheduler="fcfs", ops="torch"),
])
def test_greedy_tokens_equal_transformers(folder, reference, engine):
    chats, two = reference
    llm = LLM(str(folder), dtype="float32", **engine)
    assert_same(answers(llm.chat(conversations(), PARAMS, use_tqdm=False)), chats, 2e-3)
    prompt = {"prompt": TWO_IMAGES, "multi_modal_data": {"image": [picture(0), picture(5, (60, 30))]}}
    assert_same(answers(llm.generate(prompt, PARAMS, use_tqdm=False)), [two], 2e-3)


def test_token_id_prompts_with_images_equal_transformers(folder, reference):
    llm = LLM(str(folder), dtype="float32")
    prompt = {"prompt_token_ids": llm.get_tokenizer()(TWO_IMAGES)["input_ids"],
              "multi_modal_data": {"image": [picture(0), picture(5, (60, 30))]}}
    assert_same(answers(llm.generate(prompt, PARAMS, use_tqdm=False)), [reference[1]], 2e-3)


def test_group_prefixes_stop_before_an_image(folder):
    """Questions of one image that part right after it, in blocks of 16 without prefix caching: BatchLLM's group
    prefix of whole blocks would end inside the image, so it stops before it."""
    texts = [f"Look: <start_of_image>{q}" for q in ("A", "B", "C")]
    want = transformers_greedy(folder, [(t, [picture(2)], True) for t in texts])
    llm = LLM(str(folder), dtype="float32", scheduler="batchllm", enable_prefix_caching=False, block_size=16)
    got = llm.generate([{"prompt": t, "multi_modal_data": {"image": picture(2)}} for t in texts], PARAMS,
                       use_tqdm=False)
    assert_same(answers(got), want, 2e-3)


def test_float64_and_bfloat16(folder, reference):
    text = "A long run of words before the picture, so that the window slides: <start_of_image> and after it"
    images = [picture(7)]
    want = transformers_greedy(folder, [(text, images, True)], torch.float64)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    assert_same(answers(LLM(str(folder), dtype="float64").generate(prompt, PARAMS, use_tqdm=False)), want, 1e-6)
    out = LLM(str(folder), dtype="bfloat16").chat(conversations()[0], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == NEW and out[0] == reference[0][0][0][0]


def test_steps_never_end_inside_an_image(folder):
    """The chunk rule: cut before an image, or stretched to its end when the chunk starts in or at it."""
    ids, images = image_prompts(str(folder)).encode("words <start_of_image> more", [picture(0)])
    (first, stop), = images.spans.tolist()
    assert stop - first == 16 and ids[first - 1] != ids[first]
    assert images.fit_chunk(0, first + 3) == first  # would end inside: stops before it
    assert images.fit_chunk(first, 8) == 16 and images.fit_chunk(first + 5, 2) == stop - first - 5  # stretched
    assert images.fit_chunk(0, stop + 1) == stop + 1 and images.fit_chunk(0, first) == first
    assert images.prefix_end(first + 1) == first and images.prefix_end(stop) == stop
    assert images.attend_ends(np.arange(first - 1, stop + 1)).tolist() == [first - 1] + [stop - 1] * 16 + [stop]
