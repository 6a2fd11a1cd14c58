"""AsyncEngine in-process: streaming, abort, and a failing step (fails its requests, the server keeps going),
also through the app with httpx's ASGI transport."""

import asyncio
import json
import math
import time

import httpx
import pytest

from flock.api.metrics import Metrics
from flock.api.server_app import build_app
from flock.api.server_generate import ServerContext
from flock.config import EngineConfig
from flock.engine.async_engine import AsyncEngine
from flock.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    e = AsyncEngine(EngineConfig.from_kwargs("flock/tiny", num_kv_blocks=128)).start()
    yield e
    e.shutdown()
    assert not e.is_running


@pytest.fixture
def failing_steps(engine, monkeypatch):
    """Make the next `n` model steps raise."""
    runner = engine._engine.runner  # patched while the engine thread is idle
    real, left = runner.run, [0]

    def run(plan):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected failure")
        return real(plan)

    monkeypatch.setattr(runner, "run", run)
    return left


def ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=True)


def wait_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (s := engine.state).num_running or s.num_waiting or s.num_active or s.kv_blocks_used:
        assert time.monotonic() < deadline, s
        time.sleep(0.01)


async def collect(stream) -> list:
    return [out async for out in stream]


async def collect_one(engine, prompt, params):
    return await collect(engine.add_request(ids(engine, prompt), params))


def test_stream_outputs_add_up(engine):
    outs = asyncio.run(collect_one(engine, "hello there", GREEDY))
    assert outs[-1].finish_reason == "length" and all(not o.finished for o in outs[:-1])
    assert [o.num_output_tokens for o in outs] == sorted({o.num_output_tokens for o in outs})
    assert outs[-1].num_output_tokens == 6 and outs[-1].num_prompt_tokens == len(ids(engine, "hello there"))
    # text that may start a stop string waits for the next, but not when the stop string is kept (as vLLM)
    far = "a stop string longer than any output here"
    for keep in (False, True):
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[far],
                                include_stop_str_in_output=keep)
        texts = [o.text for o in asyncio.run(collect_one(engine, "hello there", params))]
        assert any(texts[:-1]) == keep and "".join(texts)
    wait_idle(engine)



def test_state_reports_the_engine_thread_time(engine):
    before = engine.state
    outs = asyncio.run(collect_one(engine, "count the steps", GREEDY))
    wait_idle(engine)
    after = engine.state
    prompt = outs[-1].num_prompt_tokens
    assert after.steps - before.steps >= GREEDY.max_tokens  # one step per decode token, the prefill in the first
    assert after.step_tokens - before.step_tokens == prompt + GREEDY.max_tokens - 1
    model, busy = after.model_seconds - before.model_seconds, after.busy_seconds - before.busy_seconds
    assert 0 < model <= busy


def test_abort_frees_the_request(engine):
    async def go():
        stream = engine.add_request(ids(engine, "a long one"), SamplingParams(max_tokens=5000, ignore_eos=True))
        first = await anext(stream)
        stream.abort()
        return first, await collect(stream)

    first, rest = asyncio.run(go())
    assert first.num_output_tokens >= 1 and rest[-1].finish_reason == "abort"
    wait_idle(engine)


def test_bad_request_is_rejected_before_submission(engine):
    async def go():
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request([5] * (engine.max_model_len + 1), GREEDY)
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_request([10**9], GREEDY)

    asyncio.run(go())
    assert engine.state.num_active == 0


def test_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine, failing_steps):
    failing_steps[0] = 1

    async def go():
        streams = [engine.add_request(ids(engine, f"prompt {i}"), GREEDY) for i in range(3)]
        return [(await collect(s))[-1] for s in streams]

    ends = asyncio.run(go())
    errors = [e for e in ends if e.finish_reason == "error"]
    assert errors and "injected failure" in errors[0].error
    assert all(e.finish_reason in ("error", "length") for e in ends)
    wait_idle(engine)
    assert asyncio.run(collect_one(engine, "after the failure", GREEDY))[-1].finish_reason == "length"


def test_failing_step_gives_500_whole_and_an_error_event_streamed(engine, failing_steps):
    app = build_app(ServerContext(engine, Metrics(engine), ["m"]))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            failing_steps[0] = 1
            whole = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            failing_steps[0] = 1
            streamed = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
            ok = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            return whole, streamed, ok

    whole, streamed, ok = asyncio.run(go())
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["error"]["message"] and events[-1] == "[DONE]"
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    wait_idle(engine)


def test_reset_prefix_cache_version_and_ping(engine):
    """vLLM's /reset_prefix_cache and SGLang's /flush_cache forget the cached prefixes of an idle engine (a prompt
    sent again computes everything, with the same tokens), and refuse while a request runs; /version, /ping."""
    import flock
    from flock.engine.engine import LLMEngine

    app = build_app(ServerContext(engine, Metrics(engine), ["m"]))
    prompt = {"prompt": list(range(40, 90)), "max_tokens": 3, "temperature": 0}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            first = (await http.post("/v1/completions", json=prompt)).json()
            cached = (await http.post("/v1/completions", json=prompt)).json()
            reset = (await http.post("/reset_prefix_cache")).json()
            cold = (await http.post("/v1/completions", json=prompt)).json()
            flushed = await http.post("/flush_cache")
            meta = (await http.get("/version")).json(), (await http.get("/ping")).status_code
            return first, cached, reset, cold, flushed, meta

    first, cached, reset, cold, flushed, meta = asyncio.run(go())
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 40 and reset == {"success": True}
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["choices"][0]["text"] == cold["choices"][0]["text"]
    assert flushed.status_code == 200 and meta == ({"version": flock.__version__}, 200)
    busy = LLMEngine(EngineConfig.from_kwargs("flock/tiny", num_kv_blocks=64))
    busy.add_request([1, 2, 3], GREEDY)
    assert busy.reset_prefix_cache() is False  # a request waits: nothing changes
    while busy.has_unfinished():
        busy.step()
    assert busy.reset_prefix_cache() is True


def test_response_ids_the_client_gives(engine):
    """vLLM's request_id field names the response (chatcmpl- / cmpl- and it); an X-Request-Id header wins."""
    app = build_app(ServerContext(engine, Metrics(engine), ["m"]))
    body = {"prompt": "x", "max_tokens": 1, "request_id": "from-body"}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            plain = (await http.post("/v1/completions", json=body)).json()["id"]
            header = (await http.post("/v1/completions", json=body, headers={"X-Request-Id": "hdr"})).json()["id"]
            chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "request_id": "c1"}
            return plain, header, (await http.post("/v1/chat/completions", json=chat)).json()["id"]

    assert asyncio.run(go()) == ("cmpl-from-body", "cmpl-hdr", "chatcmpl-c1")


def test_generative_scoring_vllm_and_sglang_shapes(engine):
    """vLLM's /generative_scoring (the first label's probability among the labels) and SGLang's /v1/score with
    label_token_ids (every label's probability over the vocabulary) agree with each other and with the label
    logprobs /v1/completions lists; bad bodies are refused by field, and /v1/score without labels stays vLLM's
    (pair scores)."""
    app = build_app(ServerContext(engine, Metrics(engine), ["m"]))
    query, items, labels = list(range(40, 70)), [[5], [6, 7], [8, 9, 10]], [11, 12, 13]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            body = {"query": query, "items": items, "label_token_ids": labels}
            vllm = (await http.post("/generative_scoring", json=body | {"request_id": "r"})).json()
            sglang = (await http.post("/v1/score", json=body | {"model": "m"})).json()
            listed = (await http.post("/v1/completions", json={"prompt": query + items[1], "max_tokens": 1,
                                                              "logprobs": 1, "logprob_token_ids": labels})).json()
            bad = [(await http.post(path, json=sent)).json()["error"]["param"] for path, sent in [
                ("/generative_scoring", body | {"label_token_ids": [10**6]}), ("/v1/score", body | {"items": []}),
                ("/generative_scoring", body | {"top_k": 3}), ("/v1/score", body | {"items": [query * 200]}),
                ("/v1/completions", {"prompt": "x", "logprob_token_ids": [1]})]]
            pairs = await http.post("/v1/score", json={"text_1": "a", "text_2": "b"})
            return vllm, sglang, listed, bad, pairs

    vllm, sglang, listed, bad, pairs = asyncio.run(go())
    assert vllm["id"] == "generative-scoring-r" and [d["index"] for d in vllm["data"]] == [0, 1, 2]
    assert vllm["usage"]["prompt_tokens"] == 3 * 30 + 6 and vllm["usage"]["completion_tokens"] == 3
    assert sglang["object"] == "scoring" and sglang["model"] == "m" and len(sglang["scores"]) == 3
    for d, s in zip(vllm["data"], sglang["scores"]):
        assert len(s) == 3 and 0 < sum(s) < 1
        assert d["score"] == pytest.approx(s[0] / sum(s), rel=2e-2)
    top = listed["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(top) in (3, 4)  # the labels, and the chosen token unless it is one
    texts = [engine.tokenizer.decode([t]) for t in labels]
    assert [math.exp(top[t]) for t in texts] == pytest.approx(sglang["scores"][1], rel=2e-2)
    assert bad == ["label_token_ids", "items", "top_k", "items", "logprob_token_ids"]
    assert pairs.status_code == 200 and -1 <= pairs.json()["data"][0]["score"] <= 1  # cosine of the embeddings


def test_sglang_token_ids_logprob(engine):
    """SGLang's token_ids_logprob on /generate: the listed tokens' logprobs at each input position from
    logprob_start_len and at each output token, as [logprob, id, text] triples; a listed token that is the
    prompt's own there has the prompt token's logprob."""
    app = build_app(ServerContext(engine, Metrics(engine), ["m"]))
    prompt, listed = list(range(40, 70)), [45, 60]
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            body = {"input_ids": prompt, "sampling_params": greedy, "return_logprob": True, "logprob_start_len": 0}
            ids = (await http.post("/generate", json=body | {"token_ids_logprob": listed})).json()["meta_info"]
            own = (await http.post("/generate", json=body)).json()["meta_info"]
            bad = [(await http.post("/generate", json=body | change)).json()["error"]["param"] for change in
                   ({"token_ids_logprob": listed, "top_logprobs_num": 2}, {"token_ids_logprob": [1, "x"]},
                    {"token_ids_logprob": listed, "return_logprob": False})]
            return ids, own, bad

    ids, own, bad = asyncio.run(go())
    inputs, outputs = ids["input_token_ids_logprobs"], ids["output_token_ids_logprobs"]
    assert len(inputs) == len(prompt) and inputs[0] is None and len(outputs) == 3
    assert all([t for _, t, _ in row] == listed for row in inputs[1:] + outputs)
    for position, token in ((5, 45), (20, 60)):
        assert inputs[position][listed.index(token)][0] == pytest.approx(own["input_token_logprobs"][position][0],
                                                                         abs=2e-2)
    assert bad == ["token_ids_logprob"] * 3


def test_pooling_answers_the_models_embeddings(engine):
    """vLLM's /pooling: a causal LM's default task embeds; each vector as `data`, as /v1/embeddings gives it."""
    app = build_app(ServerContext(engine, Metrics(engine), ["m"]))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            pooled = (await http.post("/pooling", json={"input": ["a b c", "d e"]})).json()
            embedded = (await http.post("/v1/embeddings", json={"input": ["a b c", "d e"]})).json()
            return pooled, embedded

    pooled, embedded = asyncio.run(go())
    assert [d["data"] for d in pooled["data"]] == [pytest.approx(d["embedding"], abs=1e-6) for d in embedded["data"]]
    assert pooled["usage"] == embedded["usage"] and pooled["object"] == "list"


def test_bodies_are_parsed_off_the_event_loop(engine, monkeypatch):
    """A prompt is tokenized (a chat's template rendered) on the server's parsing thread, so a huge one holds up
    no other client's stream or /health."""
    import threading

    app = build_app(ServerContext(engine, Metrics(engine), ["m"]))
    tokenizer, threads = engine.tokenizer, []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: threads.append(threading.current_thread().name)
                        or encode(*a, **k))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            for path, body in (("/v1/completions", {"prompt": "x"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
                r = await http.post(path, json=body | {"max_tokens": 2})
                assert r.status_code == 200, r.text

    asyncio.run(go())
    assert threads and all(name.startswith("flock-parse") for name in threads)
    wait_idle(engine)


def test_sagemakers_invocations_route_answers_chats_and_completions(engine):
    """vLLM's POST /invocations (SageMaker's inference route, beside /ping): a chat body or a completion body."""
    app = build_app(ServerContext(engine, Metrics(engine), ["m"]))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            chat = await http.post("/invocations", json={"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 2})
            text = await http.post("/invocations", json={"prompt": "x", "max_tokens": 2})
            neither = await http.post("/invocations", json={"input": "x"})
            return chat, text, neither

    chat, text, neither = asyncio.run(go())
    assert chat.json()["object"] == "chat.completion" and text.json()["object"] == "text_completion"
    assert neither.status_code == 400
    wait_idle(engine)


def test_the_servers_body_defaults_apply_where_a_body_is_silent(engine):
    """vLLM's --return-tokens-as-token-ids: logprobs' tokens as "token_id:N" unless the body says otherwise."""
    app = build_app(ServerContext(engine, Metrics(engine), ["m"], body_defaults={"return_tokens_as_token_ids": True}))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            body = {"prompt": "x", "max_tokens": 2, "logprobs": 1}
            return [(await http.post("/v1/completions", json=body | extra)).json()["choices"][0]["logprobs"]["tokens"]
                    for extra in ({}, {"return_tokens_as_token_ids": False})]

    as_ids, as_text = asyncio.run(go())
    assert all(t.startswith("token_id:") for t in as_ids) and not any(t.startswith("token_id:") for t in as_text)
    wait_idle(engine)
