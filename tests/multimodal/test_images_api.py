"""Images through the server and batch jobs: chat image_url parts (data: URLs), the Responses API's input_image
parts and SGLang's image_data give LLM.chat's answers, streamed or not, and use_beam_search LLM.beam_search's; what
cannot be read is a 400 naming why, and the rest of a batch goes on."""

import asyncio
import base64
import io
import json

import httpx
import pytest

from flock import LLM, SamplingParams
from flock.beam_search import BeamSearchParams
from flock.api.batch import JobConfig, run_job
from flock.api.metrics import Metrics
from flock.api.server_app import build_app
from flock.api.server_generate import ServerContext
from flock.config import EngineConfig
from flock.engine.async_engine import AsyncEngine
from flock.engine.engine import LLMEngine
from flock.multimodal.processor import image_prompts
from tests.multimodal.models import picture

QUESTION = "What is this?"


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def body(url: str, question: str = QUESTION, **extra) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True} | extra


@pytest.fixture(scope="module")
def expected(llava_folder):
    llm = LLM(str(llava_folder), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": picture(seed)},
                                                   {"type": "text", "text": QUESTION}]}], params,
                     use_tqdm=False)[0].outputs[0].text for seed in range(2)]


def expected_prompt(folder) -> str:
    """The chat template's text of `body`'s message, its image a placeholder."""
    tokenizer = LLM(str(folder), load_format="dummy").engine.tokenizer
    return tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                          "text": QUESTION}]}],
                                         tokenize=False, add_generation_prompt=True)


def test_chat_image_urls_answer_as_llm_chat(llava_folder, expected, tmp_path):
    engine = AsyncEngine(EngineConfig.from_kwargs(str(llava_folder), dtype="float32")).start()
    ctx = ServerContext(engine, Metrics(engine), ["llava"])
    picture(0).save(tmp_path / "a.png")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)), base_url="http://t") as http:
            answers = [await http.post("/v1/chat/completions", json=body(data_url(picture(s)))) for s in range(2)]
            streamed = await http.post("/v1/chat/completions", json=body(data_url(picture(1)), stream=True))
            beams = await http.post("/v1/chat/completions", json=body(data_url(picture(0)), use_beam_search=True, n=2))
            bad = [await http.post("/v1/chat/completions", json=b) for b in (
                body("data:image/png;base64,@@@"), body(str(tmp_path / "a.png")), body(f"file://{tmp_path}/a.png"),
                {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
                {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                              {"role": "assistant", "content": "ok"}, *body("data:image/png;base64,AAAA")["messages"]]})]
            return answers, streamed, beams, bad

    try:
        answers, streamed, beams, bad = asyncio.run(go())
    finally:
        engine.shutdown()
    assert [a.json()["choices"][0]["message"]["content"] for a in answers] == expected
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == expected[1]
    llm = LLM(str(llava_folder), dtype="float32")
    offline = llm.beam_search({"prompt": expected_prompt(llava_folder), "multi_modal_data": {"image": picture(0)}},
                              BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))[0].sequences
    assert [c["message"]["content"] for c in beams.json()["choices"]] == [
        llm.engine.tokenizer.decode(b.output_token_ids, skip_special_tokens=True) for b in offline]
    assert all(b.status_code == 400 for b in bad)
    messages = [b.json()["error"]["message"] for b in bad]
    assert "not valid base64" in messages[0]
    assert "only data: and http(s): URLs" in messages[1] and "only data: and http(s): URLs" in messages[2]
    assert "only image_url and text parts" in messages[3]
    assert bad[4].json()["error"]["param"] == "messages[2].content"  # the message with the bad image


def test_a_text_only_model_refuses_images(hf_folders):
    engine = AsyncEngine(EngineConfig.from_kwargs(str(hf_folders["llama"]), dtype="float32")).start()
    ctx = ServerContext(engine, Metrics(engine), ["llama"])

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)), base_url="http://t") as http:
            return await http.post("/v1/chat/completions", json=body(data_url(picture(0))))

    try:
        answer = asyncio.run(go())
    finally:
        engine.shutdown()
    assert answer.status_code == 400 and "takes no images" in answer.json()["error"]["message"]


def test_batch_lines_with_images(llava_folder, expected, tmp_path):
    engine = LLMEngine(EngineConfig.from_kwargs(str(llava_folder), dtype="float32"))
    bodies = [body(data_url(picture(0))), body("data:image/png;base64,iVBORw0KGgo="), body(data_url(picture(1)))]
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
             for i, b in enumerate(bodies)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(line) for line in lines))
    run_job(JobConfig(str(inp), str(tmp_path / "out.jsonl"), quiet=True), engine)
    out = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert [out[c]["choices"][0]["message"]["content"] for c in ("c0", "c2")] == expected
    errors = (tmp_path / "out.errors.jsonl").read_text()
    assert "c1" in errors and "not an image PIL can read" in errors


def test_responses_input_image_and_sglang_image_data(llava_folder, expected):
    engine = AsyncEngine(EngineConfig.from_kwargs(str(llava_folder), dtype="float32")).start()
    ctx = ServerContext(engine, Metrics(engine), ["llava"])
    url = data_url(picture(0))
    responses = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                        {"type": "input_text", "text": QUESTION}]}],
                 "max_output_tokens": 6, "temperature": 0}
    processor = image_prompts(str(llava_folder))
    text = processor.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], add_generation_prompt=True)
    native = {"text": text, "image_data": url.split(",", 1)[1],  # bare base64, as SGLang takes it
              "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)), base_url="http://t") as http:
            answer = await http.post("/v1/responses", json=responses)
            generated = await http.post("/generate", json=native)
            missing = await http.post("/v1/responses", json={"input": [{"role": "user", "content": [
                {"type": "input_image", "file_id": "f1"}]}]})
            return answer, generated, missing

    try:
        answer, generated, missing = asyncio.run(go())
    finally:
        engine.shutdown()
    assert answer.json()["output"][0]["content"][0]["text"] == expected[0]
    assert generated.json()["text"].startswith(expected[0])  # the chat text adds no BOS here: the same tokens
    assert missing.status_code == 400 and "file_id is not supported" in missing.json()["error"]["message"]
