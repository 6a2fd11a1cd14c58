"""Image inputs of vision-language models (LLaVA, Idefics3): greedy tokens equal transformers' under every
scheduler, with prompts cut into chunks and preempted; prefix-cache blocks shared up to the first image, and past
it only for the same pixels; bad images refused by name."""

import base64
import io

import pytest
import torch

from flock import LLM, SamplingParams
from flock.multimodal.processor import image_prompts
from tests.multimodal.models import picture

QUESTIONS = ["What is this?", "Describe the colors.", "Count the things."]
NEW = 8
SYSTEM = {"role": "system", "content": "You answer questions about pictures in a few plain words, nothing else."}


def chat(image, question: str) -> list[dict]:
    """The system prompt, then the image and the question."""
    return [SYSTEM, {"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def reference(llava_folder):
    """transformers' greedy tokens for 3 images x 3 questions (chat) and for one text prompt with two images."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(llava_folder)
    model = LlavaForConditionalGeneration.from_pretrained(llava_folder, dtype=torch.float32)

    def greedy(text, images, special):
        inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=special)
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    chats = []
    for seed in range(3):
        for q in QUESTIONS:
            text = processor.apply_chat_template(
                [SYSTEM, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                add_generation_prompt=True)
            chats.append(greedy(text, [picture(seed)], False))
    two = greedy("Compare <image> with <image> please:", [picture(0), picture(5, (60, 30))], True)
    return chats, two


PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("engine", [
    dict(scheduler="fcfs"), dict(scheduler="batchllm"), dict(scheduler="feather"), dict(scheduler="lpm"),
    dict(scheduler="fcfs", max_num_batched_tokens=16, enable_chunked_prefill=True),  # images cut across chunks
    dict(scheduler="fcfs", num_kv_blocks=18, block_size=4),  # preempted and recomputed
    dict(scheduler="fcfs", enable_prefix_caching=False),
])
def test_greedy_tokens_equal_transformers(llava_folder, reference, engine):
    chats, two = reference
    llm = LLM(str(llava_folder), dtype="float32", **engine)
    conversations = [chat(picture(seed), q) for seed in range(3) for q in QUESTIONS]
    got = [o.outputs[0].token_ids for o in llm.chat(conversations, PARAMS, use_tqdm=False)]
    assert got == chats
    prompt = {"prompt": "Compare <image> with <image> please:",
              "multi_modal_data": {"image": [picture(0), picture(5, (60, 30))]}}
    assert llm.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == two


def test_token_id_prompts_take_images_as_their_text(llava_folder, reference):
    """vLLM's token prompt with multi_modal_data: the ids of the text prompt answer as the text; ids that are not
    their text's tokens are refused by name."""
    llm = LLM(str(llava_folder), dtype="float32")
    tok = llm.get_tokenizer()
    images = {"image": [picture(0), picture(5, (60, 30))]}
    ids = tok("Compare <image> with <image> please:")["input_ids"]
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": images}, PARAMS, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference[1]
    split = tok.convert_tokens_to_ids(list("the")) + ids  # "t", "h", "e" where the text is one token
    with pytest.raises(ValueError, match="request 0: prompt_token_ids with images must be the tokens of their text"):
        llm.generate({"prompt_token_ids": split, "multi_modal_data": images}, PARAMS, use_tqdm=False)


@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm"])
def test_idefics3_tiles_equal_transformers(idefics3_folder, scheduler):
    """Idefics3 (SmolVLM's family): each image split into tiles plus a global view, a pixel-shuffle connector."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(idefics3_folder)
    model = Idefics3ForConditionalGeneration.from_pretrained(idefics3_folder, dtype=torch.float32)
    prompts = [("User:<image>What is this?\nAssistant:", [picture(0)]),
               ("User:<image>What is this?\nAssistant:", [picture(1, (30, 70))]),
               ("User:<image> or <image>, which is brighter?\nAssistant:", [picture(0), picture(2)])]
    want = []
    for text, images in prompts:
        inputs = processor(text=text, images=images, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        want.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    llm = LLM(str(idefics3_folder), dtype="float32", scheduler=scheduler)
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts], PARAMS,
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_a_template_that_writes_contents_as_text_gets_the_images_placeholder(idefics3_folder):
    """A chat template that prints a content as text ("string": the test Idefics3's) gets each image as the
    model's placeholder before the text, as vLLM writes it (it printed the parts list, with no placeholder)."""
    llm = LLM(str(idefics3_folder), dtype="float32")
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture(0)},
                                         {"type": "text", "text": "What?"}]}]
    out = llm.chat(chat, PARAMS, use_tqdm=False)[0]
    assert "<image>\nWhat?" in out.prompt and out.outputs[0].token_ids
    text = llm.generate({"prompt": out.prompt, "multi_modal_data": {"image": [picture(0)]}}, PARAMS, use_tqdm=False)
    assert text[0].outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm", "lpm"])
def test_blocks_are_shared_up_to_the_first_image_and_past_it_for_the_same_pixels(llava_folder, scheduler):
    llm = LLM(str(llava_folder), dtype="float32", block_size=4, scheduler=scheduler)
    text = llm.engine.tokenizer.apply_chat_template([SYSTEM, {"role": "user", "content": [{"type": "image"}]}],
                                                    tokenize=False)
    before = int(image_prompts(str(llava_folder)).encode(text, [picture(0)], False)[1].positions[0])
    llm.chat([chat(picture(0), q) for q in QUESTIONS], PARAMS, use_tqdm=False)
    stats = llm.stats()  # the later questions read the system prompt and the image's 16 rows from the cache
    assert stats["cached_prefill_tokens"] >= 2 * (before + 16 - 3)
    llm.reset_prefix_cache()
    llm.chat([chat(picture(seed), QUESTIONS[0]) for seed in range(3)], PARAMS, use_tqdm=False)
    stats = llm.stats()  # the same tokens, other pixels: the system prompt only (batchllm counts all 3 reading it)
    assert 2 * (before - 3) <= stats["cached_prefill_tokens"] <= 3 * before


def test_bfloat16_runs_images(llava_folder, reference):
    llm = LLM(str(llava_folder), dtype="bfloat16")
    out = llm.chat(chat(picture(0), QUESTIONS[0]), PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == NEW and out[0] == reference[0][0][0]


def test_bad_images_are_refused_by_name(llava_folder, hf_folders, tmp_path):
    llm = LLM(str(llava_folder), dtype="float32")
    with pytest.raises(ValueError, match="request 0: .*processor refused the prompt's 1 image"):
        llm.generate({"prompt": "no placeholder here", "multi_modal_data": {"image": picture(0)}}, PARAMS)
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate({"prompt": "<image> x", "multi_modal_data": {"image": str(tmp_path / "none.png")}}, PARAMS)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="not an image PIL can read"):
        llm.generate({"prompt": "<image> x", "multi_modal_data": {"image": str(tmp_path / "bad.png")}}, PARAMS)
    with pytest.raises(ValueError, match="multi_modal_data takes {'image': images} only"):
        llm.generate({"prompt": "<image> x", "multi_modal_data": {"audio": b""}}, PARAMS)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate({"prompt": "<image> x", "multi_modal_data": {"image": picture(0)}},
                     SamplingParams(truncate_prompt_tokens=4))
    with pytest.raises(ValueError, match="taken by generate and chat only"):
        llm.embed({"prompt": "<image> x", "multi_modal_data": {"image": picture(0)}})
    text_only = LLM(str(hf_folders["llama"]), dtype="float32")
    with pytest.raises(ValueError, match="takes no images: it is a text-only model"):
        text_only.chat(chat(picture(0), "hi"), PARAMS)


def test_an_image_file_and_data_url_read_as_the_pil_image(llava_folder, tmp_path):
    llm = LLM(str(llava_folder), dtype="float32")
    image = picture(3)
    image.save(tmp_path / "a.png")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    answers = [llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}], PARAMS,
                        use_tqdm=False)[0].outputs[0].token_ids
               for part in ({"type": "image_pil", "image_pil": image}, {"type": "image_url", "image_url": {"url": url}},
                            {"type": "image_url", "image_url": str(tmp_path / "a.png")})]
    assert answers[0] == answers[1] == answers[2]
