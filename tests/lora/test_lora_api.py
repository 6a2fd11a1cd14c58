"""LoRA adapters through the OpenAI server and batch jobs: a request's model names its adapter (vLLM's
--lora-modules; SGLang's lora_path on /generate), /v1/models lists them, the answers are the adapter's,
embeddings of an adapter are refused."""

import asyncio
import json

import httpx
import pytest

from flock import LLM, LoRARequest, SamplingParams
from flock.api.batch import JobConfig, run_job
from flock.api.metrics import Metrics
from flock.api.server_app import build_app
from flock.api.server_generate import ServerContext
from flock.config import EngineConfig
from flock.engine.async_engine import AsyncEngine
from flock.engine.engine import LLMEngine
from flock.lora import lora_requests
from tests.lora.adapters import ALL_LLAMA, make_adapter

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def setup(hf_folders, tmp_path_factory):
    """The Llama test model, an adapter of it, and each one's greedy completion of PROMPT (LLM, float32)."""
    base = hf_folders["llama"]
    adapter = make_adapter(base, tmp_path_factory.mktemp("api-lora") / "sql", 5, ALL_LLAMA)
    llm = LLM(str(base), dtype="float32", enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = {lora: llm.generate(PROMPT, params, use_tqdm=False,
                                   lora_request=lora and LoRARequest(lora, 1, str(adapter)))[0].outputs[0].text
                for lora in ("sql", None)}
    assert expected["sql"] != expected[None]
    return base, adapter, expected


def test_the_server_routes_a_model_name_to_its_adapter(setup):
    base, adapter, expected = setup
    config = EngineConfig.from_kwargs(str(base), dtype="float32", lora_modules=[f"sql={adapter}"])
    engine = AsyncEngine(config).start()
    ctx = ServerContext(engine, Metrics(engine), ["base"], loras=lora_requests(config.lora_modules))
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)), base_url="http://t") as http:
            models = (await http.get("/v1/models")).json()["data"]
            answers = [await http.post("/v1/completions", json=body | {"model": m}) for m in ("sql", "base")]
            streamed = await http.post("/v1/completions", json=body | {"model": "sql", "stream": True})
            missing = await http.post("/v1/completions", json=body | {"model": "nope"})
            embedding = await http.post("/v1/embeddings", json={"model": "sql", "input": "x"})
            native = {"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
            sglang = [await http.post("/generate", json=native | {"lora_path": name}) for name in ("sql", "nope")]
            runtime = await http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapter)})
            assert runtime.status_code == 404  # without VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM
            return models, answers, streamed, missing, embedding, sglang

    try:
        models, answers, streamed, missing, embedding, sglang = asyncio.run(go())
    finally:
        engine.shutdown()
    assert [(m["id"], m["parent"], m["root"]) for m in models] == [("base", None, str(base)), ("sql", "base", str(adapter))]
    assert [a.json()["choices"][0]["text"] for a in answers] == [expected["sql"], expected[None]]
    assert [a.json()["model"] for a in answers] == ["sql", "base"]
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected["sql"]
    assert missing.status_code == 404
    assert embedding.status_code == 400 and "LoRA adapter" in embedding.json()["error"]["message"]
    assert sglang[0].json()["text"] == expected["sql"]  # SGLang's /generate names the adapter by lora_path
    assert sglang[1].status_code == 400 and "lora_path" in sglang[1].text


def test_batch_lines_pick_their_adapter_by_model(setup, tmp_path):
    base, adapter, expected = setup
    engine = LLMEngine(EngineConfig.from_kwargs(str(base), dtype="float32", lora_modules=[f"sql={adapter}"]))
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": url, "body": body | extra}
             for i, (url, extra) in enumerate([("/v1/completions", {"model": "sql"}), ("/v1/completions", {}),
                                               ("/v1/embeddings", {"model": "sql", "input": "x"})])]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(line) for line in lines))
    run_job(JobConfig(str(inp), str(tmp_path / "out.jsonl"), quiet=True), engine)
    out = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert (out["c0"]["model"], out["c0"]["choices"][0]["text"]) == ("sql", expected["sql"])
    assert out["c1"]["choices"][0]["text"] == expected[None]
    errors = (tmp_path / "out.errors.jsonl").read_text()
    assert "c2" in errors and "LoRA adapter" in errors


def test_adapters_load_and_unload_while_serving(setup, monkeypatch, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, behind VLLM_ALLOW_RUNTIME_LORA_UPDATING: a name
    loaded again only with load_inplace (then its new weights answer), an unload while requests run (the adapter's
    own one finishes with it), the name free again afterwards."""
    base, adapter, expected = setup
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    engine = AsyncEngine(EngineConfig.from_kwargs(str(base), dtype="float32", enable_lora=True)).start()
    ctx = ServerContext(engine, Metrics(engine), ["base"])
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "model": "sql"}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)), base_url="http://t") as http:
            before = await http.post("/v1/completions", json=body)
            loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter)})
            again = await http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter)})
            bad = await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/folder"})
            answer = await http.post("/v1/completions", json=body)
            models = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
            inplace = await http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(other),
                                                                     "load_inplace": True})
            other_answer = await http.post("/v1/completions", json=body)
            busy = [asyncio.create_task(http.post("/v1/completions", json=body | {"max_tokens": 200, "model": m}))
                    for m in ("sql", "base")]
            while not engine.state.num_running:
                await asyncio.sleep(0.01)
            unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            after = await http.post("/v1/completions", json=body)
            finished = [(await t).json()["usage"]["completion_tokens"] for t in busy]
            reloaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter)})
            return before, loaded, again, bad, answer, models, inplace, other_answer, unloaded, after, finished, \
                reloaded

    other = make_adapter(base, tmp_path / "other", 9, ALL_LLAMA)
    try:
        before, loaded, again, bad, answer, models, inplace, other_answer, unloaded, after, finished, reloaded = \
            asyncio.run(go())
    finally:
        engine.shutdown()
    assert inplace.status_code == 200 and other_answer.json()["choices"][0]["text"] not in expected.values()
    assert finished == [200, 200] and reloaded.status_code == 200
    assert before.status_code == 404 and after.status_code == 404
    assert loaded.status_code == 200 and unloaded.status_code == 200
    assert again.status_code == 400 and bad.status_code == 400 and "adapter_config.json" in bad.text
    assert answer.json()["choices"][0]["text"] == expected["sql"]
    assert models == ["base", "sql"]
