"""A live `flock serve` (flock/tiny, subprocess on a free loopback port) driven by the official openai client
and by httpx."""

import asyncio
import json
import time
from functools import partial

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flock import LLM, SamplingParams
from flock.api.protocol import encode_messages
from bench.harness.server_process import ServerProcess
from flock.attention import BACKENDS

MODEL = "tiny-served"
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
# the test process and the server share the CPUs; one torch thread keeps steps fast when they are busy
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
SYSTEM = "You are a terse assistant. Answer in one short sentence, and never repeat the question. "


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--model", "flock/tiny", "--served-model-name", MODEL, "--api-key", KEY, "sk-second",
                       "--num-kv-blocks", "1024", "--max-model-len", "2048", "--tool-call-parser", "hermes",
                       "--enable-request-id-headers", "--root-path", "/api",
                       env=ONE_THREAD) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def metrics(server) -> dict[str, float]:
    """Samples by name and labels, e.g. {'flock_requests_finished_total{reason=abort}': 3.0}."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_idle(server, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(server)
        if h["num_running"] == h["num_waiting"] == h["num_active"] == h["kv_blocks_used"] == 0:
            return h
        assert time.monotonic() < deadline, f"the server did not drain: {h}"
        time.sleep(0.1)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL] and client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other-model")
    h = health(server)
    assert h["status"] == "ok" and h["kv_blocks_total"] == 1024
    assert h["attention"].split()[0] in BACKENDS


def test_health_generate_runs_one_token(server):
    """SGLang's /health_generate: a token generated through the engine, then /health's body."""
    added = health(server)["num_added"]
    r = httpx.get(f"{server.url}/health_generate", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["num_added"] == added + 1


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="The cache is paged.", max_tokens=8, **GREEDY)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length" and isinstance(r.choices[0].text, str) and r.choices[0].text
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (8, r.usage.prompt_tokens + 8)


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                                                              {"role": "user", "content": "Why page the cache?"}],
                                       max_tokens=6, **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.usage.completion_tokens == 6


def test_stream_completion_equals_whole(client):
    kw = dict(model=MODEL, prompt="Streams arrive in pieces", max_tokens=10, **GREEDY)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_chat_equals_whole(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=7, **GREEDY)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    plain = list(client.chat.completions.create(stream=True, **kw))  # no include_usage: no usage chunk
    assert all(c.choices and c.usage is None for c in plain)


@pytest.mark.parametrize("kw,param", [({"n": 0}, "n"), ({"n": 129}, "n"), ({"best_of": 2}, "best_of"),
                                      ({"prompt": ["x", [5]]}, "prompt"), ({"prompt": []}, "prompt"), ({"temperature": -1}, "temperature"),
                                      ({"max_tokens": 0}, "max_tokens"), ({"prompt": [5] * 2100}, "prompt"),
                                      ({"extra_body": {"messages": []}}, "messages"), ({"logprobs": 21}, "logprobs"),
                                      ({"extra_body": {"priority": 1}}, "priority")])  # feather: vLLM's rule
def test_bad_request_names_the_parameter(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**({"model": MODEL, "prompt": "x"} | kw))
    assert e.value.status_code == 400 and e.value.param == param and e.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reason_as_vllm(client, stream):
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, **GREEDY)
    tokens = whole.choices[0].text
    stop = tokens[len(tokens) // 2:][:2]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, stop=[stop], stream=stream,
                                  **GREEDY)
    last = [c for c in r if c.choices][-1] if stream else r
    assert last.choices[0].finish_reason == "stop" and last.choices[0].model_extra["stop_reason"] == stop
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           **GREEDY)
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].model_extra["stop_reason"] is None


def test_a_body_nested_too_deeply_is_a_400(server):
    r = httpx.post(f"{server.url}/v1/completions", content="[" * 100_000 + "]" * 100_000, timeout=30,
                   headers=AUTH | {"Content-Type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]


@pytest.mark.parametrize("media", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_sent_as_json_is_a_400(server, media):
    """As vLLM: a web page's form post (no CORS preflight) is no API call."""
    headers = AUTH | ({"Content-Type": media} if media else {})
    r = httpx.post(f"{server.url}/v1/completions", content=json.dumps({"prompt": "x", "max_tokens": 1}),
                   headers=headers)
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                   headers=AUTH | {"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_invalid_json_and_unknown_model(server, client):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.param == "model"


def test_api_key(server):
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert e.value.code == "invalid_api_key"
    for path in ("/v1/models", "/v1/completions"):
        r = httpx.request("GET" if path.endswith("models") else "POST", server.url + path, json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without a key
    for header in (f"bearer {KEY}", "BEARER sk-second"):  # any of the keys, the scheme in any case (as vLLM)
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": header}).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "sk-second"}).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401


def test_browsers_preflight_and_responses_carry_their_request_id(server):
    """vLLM's HTTP layers: no cross-origin access by default (a preflight needs no key), with
    --enable-request-id-headers each response's X-Request-Id (the request's own, else a new one), and --root-path's
    prefix served whether a proxy forwards or strips it."""
    r = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.url}/v1/models", headers=AUTH | {"Origin": "http://example.com", "X-Request-Id": "r-1"})
    assert "access-control-allow-origin" not in r.headers and r.headers["x-request-id"] == "r-1"
    assert len(httpx.get(f"{server.url}/health").headers["x-request-id"]) == 32
    assert httpx.get(f"{server.url}/api/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL
    assert httpx.get(f"{server.url}/api/health").status_code == 200


def test_api_keys_from_the_flag_else_vllms_environment_variable(monkeypatch):
    from types import SimpleNamespace

    from flock.api.server import api_keys

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_keys(SimpleNamespace(api_key=None)) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_keys(SimpleNamespace(api_key=None)) == ["from-env"]
    assert api_keys(SimpleNamespace(api_key=["a", "b"])) == ["a", "b"]


def test_greedy_equals_offline_llm(client):
    llm = LLM("flock/tiny", num_kv_blocks=256)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Prefix sharing saves work because", SYSTEM + "What is a block table?"]
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        expected = out.outputs[0]
        full = tok.decode(expected.token_ids)  # but bytes of a character the output leaves unfinished, as vLLM
        assert full.startswith(expected.text) and set(full[len(expected.text) :]) <= {"\ufffd"}
        ids = tok.encode(prompt, add_special_tokens=True)
        for p in (prompt, ids):  # as text and as the engine tokenizer's token ids
            r = client.completions.create(model=MODEL, prompt=p, max_tokens=12, **GREEDY)
            assert r.choices[0].text == expected.text
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(expected.token_ids))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And a block pool?"}]
    expected = llm.generate({"prompt_token_ids": encode_messages(tok, messages)}, params, use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    assert r.choices[0].message.content == expected.outputs[0].text


def test_n_and_prompt_lists_equal_offline_llm(client):
    llm = LLM("flock/tiny", num_kv_blocks=256)
    prompts = ["Prefix sharing saves work because", "A block table maps"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    r = client.completions.create(model=MODEL, prompt=prompts[0], n=3, max_tokens=8, **GREEDY)
    assert [(c.index, c.text) for c in r.choices] == [(i, expected[0].text) for i in range(3)]
    n_ids = len(llm.get_tokenizer().encode(prompts[0], add_special_tokens=True))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_ids, 24)  # the prompt counts once

    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, **GREEDY)
    assert [c.text for c in r.choices] == [expected[0].text] * 2 + [expected[1].text] * 2
    assert r.usage.completion_tokens == 32 and r.usage.prompt_tokens > n_ids

    seeded = [llm.generate(prompts[1], SamplingParams(temperature=1, seed=s, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text for s in (11, 12)]
    assert seeded[0] != seeded[1]
    r = client.completions.create(model=MODEL, prompt=prompts[1], n=2, seed=11, temperature=1, max_tokens=8,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == seeded

    messages = [{"role": "user", "content": "Say something."}]
    chat = llm.generate({"prompt_token_ids": encode_messages(llm.get_tokenizer(), messages)}, greedy,
                        use_tqdm=False)[0].outputs[0].text
    r = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=8, **GREEDY)
    assert [(c.index, c.message.content) for c in r.choices] == [(0, chat), (1, chat)]


@pytest.mark.parametrize("chat", [False, True])
def test_stream_with_n_reassembles_to_whole(client, chat):
    if chat:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me more."}], n=2, seed=5, temperature=1,
                  max_tokens=9, extra_body={"ignore_eos": True})
        create, text_of = client.chat.completions.create, lambda c: c.delta.content or ""
    else:
        kw = dict(model=MODEL, prompt=["Streams arrive", "in pieces"], n=2, seed=5, temperature=1, max_tokens=9,
                  extra_body={"ignore_eos": True})
        create, text_of = client.completions.create, lambda c: c.text
    whole = create(**kw)
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, reasons = [""] * len(whole.choices), [[] for _ in whole.choices]
    for c in chunks[:-1]:
        assert len(c.choices) == 1 and c.usage is None
        texts[c.choices[0].index] += text_of(c.choices[0])
        reasons[c.choices[0].index].append(c.choices[0].finish_reason)
    whole_texts = [c.message.content if chat else c.text for c in whole.choices]
    assert texts == whole_texts and len(set(whole_texts)) > 1
    assert all(r[-1] == "length" and r.count("length") == 1 for r in reasons)  # each choice ends once
    usage, expected = chunks[-1].usage, whole.usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (
        expected.prompt_tokens, expected.completion_tokens)
    options = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's: each chunk has its choice's usage
    running = list(create(stream=True, stream_options=options, **kw))
    last = {}
    for c in running[:-1]:
        k, u = c.choices[0].index, c.usage
        assert u.completion_tokens >= last.get(k, 0) and u.total_tokens == u.prompt_tokens + u.completion_tokens
        last[k] = u.completion_tokens
    assert list(last.values()) == [9] * len(whole.choices) and running[-1].usage.completion_tokens == 9 * len(last)


def test_penalties_and_logit_bias_equal_offline_llm(client):
    llm = LLM("flock/tiny", num_kv_blocks=256)
    prompt = "Repeat after me: the cache, the cache, the cache"
    fields = dict(presence_penalty=0.8, frequency_penalty=0.6, logit_bias={"17": 5.0, "90": -100})
    extra = dict(repetition_penalty=1.3, min_tokens=5, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=12, **fields, **extra)
    expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert expected.token_ids != plain.outputs[0].token_ids  # the fields change this output
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, **fields, extra_body=extra)
    assert r.choices[0].text == expected.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logit_bias={"99999999": 1})
    assert e.value.param == "logit_bias"


@pytest.fixture(scope="module")
def offline():
    return LLM("flock/tiny", num_kv_blocks=256)


def test_completion_logprobs_and_echo_equal_offline_llm(client, offline):
    tok = offline.get_tokenizer()
    prompt = "Prefix sharing saves work because"
    ids = tok.encode(prompt, add_special_tokens=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    out = offline.generate(prompt, params, use_tqdm=False)[0]
    expected = [e.logprob for e in out.prompt_logprobs[1:]] + [e.logprob for e in out.outputs[0].logprobs]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=3, echo=True, **GREEDY)
    c = r.choices[0]
    assert c.text == prompt + out.outputs[0].text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 6 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    full = tok.decode(ids + out.outputs[0].token_ids)  # a character's bytes are the text of the token ending it
    assert full.startswith("".join(lp.tokens)) and set(full[len("".join(lp.tokens)) :]) <= {"\ufffd"}
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
    # what lm-evaluation-harness sends for a loglikelihood: token ids, echo, logprobs=1, max_tokens=1
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert r.choices[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected[: len(ids) - 1], abs=1e-4)
    # vLLM's echo with max_tokens 0: the prompt alone, with its logprobs, streamed or not
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    assert r.choices[0].text == prompt and len(r.choices[0].logprobs.tokens) == len(ids)
    assert r.choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected[: len(ids) - 1], abs=1e-4)
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    # vLLM's prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and [got[i][str(t)]["logprob"] for i, t in enumerate(ids) if i] == pytest.approx(
        expected[: len(ids) - 1], abs=1e-4)


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_equal_whole(client, chat):
    if chat:
        kw = dict(messages=[{"role": "user", "content": "Tell me more."}], logprobs=True, top_logprobs=2)
        create = client.chat.completions.create
    else:
        kw = dict(prompt="Streams arrive in pieces", logprobs=2, echo=True)
        create = client.completions.create
    whole = create(model=MODEL, max_tokens=7, n=2, seed=3, temperature=1, extra_body={"ignore_eos": True}, **kw)
    chunks = list(create(model=MODEL, max_tokens=7, n=2, seed=3, temperature=1, extra_body={"ignore_eos": True},
                         stream=True, **kw))
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0].logprobs for c in chunks if c.choices[0].index == i and c.choices[0].logprobs]
        if chat:
            assert [t.model_dump() for lp in mine for t in lp.content] == [t.model_dump() for t in choice.logprobs.content]
            assert len(choice.logprobs.content) == 7 and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
        else:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                assert [x for lp in mine for x in getattr(lp, name)] == getattr(choice.logprobs, name)


def test_structured_outputs_over_the_api(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Yes?"}], max_tokens=40,
                                       temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content)["answer"] in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert r.choices[0].text in ("red", "green")
    bad = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strng"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format=bad)
    assert e.value.param == "response_format" and "rejected by the grammar engine" in str(e.value)


def test_tool_calls_over_the_api(client):
    """A forced call (required, a named function) follows its tool's schema and comes back in tool_calls, whole or
    streamed alike (the openai client reassembles the stream); a structural tag constrains a plain answer."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
        "required": ["city", "celsius"]}}}
    now = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[weather, now],
              max_tokens=200, temperature=0, parallel_tool_calls=False)  # then a call ends a required answer
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, reason in [(named, "stop"), ("required", "tool_calls")]:
        whole = client.chat.completions.create(tool_choice=choice, **kw).choices[0]
        assert whole.finish_reason == reason and whole.message.content == ""
        call = whole.message.tool_calls[0].function
        if choice == named:
            assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
        chunks = list(client.chat.completions.create(tool_choice=choice, stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks]
        streamed = [t for d in deltas for t in d.tool_calls or []]
        assert [(t.function.name, t.function.arguments) for t in streamed] == \
            [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
        assert chunks[-1].choices[0].finish_reason == reason and "".join(d.content or "" for d in deltas) == ""
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<answer>", "end": "</answer>",
                                                "content": {"type": "const_string", "value": "yes"}}}
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=40, temperature=0,
                                  extra_body={"response_format": tag})
    assert r.choices[0].text == "<answer>yes</answer>"


def test_responses_equal_chat_completions(server, client):
    """POST /v1/responses answers as /v1/chat/completions does for the same conversation, whole or streamed (the
    openai client's stream helper), stored for GET and for a next turn's previous_response_id, deleted on DELETE."""
    kw = dict(model=MODEL, max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    chat_kw = dict(model=MODEL, max_tokens=8, **GREEDY)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why page the cache?"}]
    r = client.responses.create(input="Why page the cache?", instructions=SYSTEM, **kw)
    chat = client.chat.completions.create(messages=first, **chat_kw)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.output[0].type == "message"
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    with client.responses.stream(input="Why page the cache?", instructions=SYSTEM, **kw) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.completed"
    assert streamed.output_text == r.output_text and streamed.usage.output_tokens == 8
    assert client.responses.retrieve(r.id).output_text == r.output_text
    listed = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in listed.data] == [("message", "user", "Why page the cache?")]

    then = client.responses.create(input="And why blocks?", previous_response_id=r.id, instructions=SYSTEM, **kw)
    history = first + [{"role": "assistant", "content": r.output_text}, {"role": "user", "content": "And why blocks?"}]
    assert then.output_text == client.chat.completions.create(messages=history, **chat_kw).choices[0].message.content
    assert then.previous_response_id == r.id and then.usage.input_tokens_details.cached_tokens > 0

    with pytest.raises(openai.BadRequestError, match="synchronous"):  # as vLLM: only background ones cancel
        client.responses.cancel(r.id)
    assert httpx.delete(f"{server.url}/v1/responses/{r.id}", headers=AUTH, timeout=10).json()["deleted"]
    for gone in (client.responses.retrieve, client.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            gone(r.id)
    unstored = client.responses.create(input="x", store=False, **kw)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # an X-Request-Id header (proxies repeat one) names no stored response; the body's request_id does, once
    same = [client.responses.create(input=text, extra_headers={"X-Request-Id": "trace-1"}, **kw) for text in "ab"]
    assert same[0].id != same[1].id and client.responses.retrieve(same[0].id).output_text == same[0].output_text
    mine = kw | {"extra_body": {"ignore_eos": True, "request_id": "mine"}}
    assert client.responses.create(input="x", **mine).id == "resp_mine"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="y", **mine)
    assert e.value.param == "request_id"
    for body, param in [({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "u"}]}]},
                         "input[0].content"), ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, **body)
        assert e.value.param == param


def test_responses_tool_calls_and_structured_text(client):
    """A forced call comes back as a function_call item (whole and streamed alike); its output goes back in as a
    function_call_output item; text.format constrains the message as response_format does."""
    weather = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}
    kw = dict(model=MODEL, input="Weather in Paris?", tools=[weather], max_output_tokens=100, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    r = client.responses.create(**kw)
    call = r.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    with client.responses.stream(**kw) as stream:
        done = [e.arguments for e in stream if e.type == "response.function_call_arguments.done"]
    assert done == [call.arguments]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    after = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Weather in Paris?"},
                                                        call.model_dump(exclude_none=True), result],
                                    tools=[weather], max_output_tokens=4, temperature=0)
    assert after.status in ("completed", "incomplete") and after.usage.input_tokens > r.usage.input_tokens
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    fmt = client.responses.create(model=MODEL, input="A city?", max_output_tokens=60, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert json.loads(fmt.output_text)["city"] in ("Paris", "Rome")


def test_messages_equal_chat_completions(server, client):
    """POST /v1/messages, through the anthropic client (its x-api-key header), answers as /v1/chat/completions does
    for the same conversation, whole or streamed; usage splits the prompt into computed and cached tokens; a stop
    sequence says which; count_tokens counts the prompt; errors come in Anthropic's shape."""
    anth = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
    user = [{"role": "user", "content": "Why page the cache?"}]
    chat = client.chat.completions.create(messages=[{"role": "system", "content": SYSTEM}] + user, model=MODEL,
                                          max_tokens=16, **GREEDY)
    text = chat.choices[0].message.content
    kw = dict(model=MODEL, system=SYSTEM, messages=user, extra_body={"temperature": 0, "ignore_eos": True})
    m = anth.messages.create(max_tokens=16, **kw)
    assert m.id.startswith("msg_") and m.content[0].text == text and m.stop_reason == "max_tokens"
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.cache_read_input_tokens > 0 and m.usage.output_tokens == 16
    with anth.messages.stream(max_tokens=16, **kw) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-1] == "message_stop"
    assert [b.text for b in streamed.content] == [text] and streamed.stop_reason == "max_tokens"
    assert streamed.usage == m.usage
    stop = text[5:8]
    stopped = anth.messages.create(max_tokens=16, stop_sequences=[stop], **kw)
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == \
        (text[: text.find(stop)], "stop_sequence", stop)
    assert anth.messages.count_tokens(model=MODEL, system=SYSTEM, messages=user).input_tokens == \
        chat.usage.prompt_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        anth.messages.create(max_tokens=16, model=MODEL, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "PDF" in e.value.body["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "messages": user}, headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="cannot be greater than max_model_len"):
        anth.messages.create(max_tokens=10**6, **kw)  # as the other endpoints refuse it
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(max_tokens=1, **kw)
    assert [(m.id, m.type) for m in anth.models.list()] == [(MODEL, "model")]


def test_messages_tool_use_and_structured_output(server):
    """A forced tool comes back as a tool_use block (whole and streamed alike) that a tool_result answers;
    output_config.format constrains the text as response_format does."""
    anth = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
    weather = {"name": "get_weather", "input_schema": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}
    user = {"role": "user", "content": "Weather in Paris?"}
    kw = dict(model=MODEL, max_tokens=100, messages=[user], tools=[weather], extra_body={"temperature": 0},
              tool_choice={"type": "tool", "name": "get_weather"})
    m = anth.messages.create(**kw)
    call = m.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.input["city"] in ("Paris", "Rome")
    assert m.stop_reason == "tool_use"
    with anth.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}
    after = anth.messages.create(model=MODEL, max_tokens=4, tools=[weather],
                                 messages=[user, {"role": "assistant", "content": m.content}, result])
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens > \
        m.usage.input_tokens + m.usage.cache_read_input_tokens
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    fmt = anth.messages.create(model=MODEL, max_tokens=60, messages=[user], extra_body={"temperature": 0},
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(fmt.content[0].text)["city"] in ("Paris", "Rome")


def test_batches_as_openai(server, client):
    """OpenAI's Files and Batch APIs through the openai client: a JSONL file uploaded, a batch created and polled
    until it completes; its output lines are what /v1/chat/completions answers, its error file holds a line that is
    not JSON, a refused request (with its 400 and the field) and a line of another endpoint; a cancelled batch ends
    cancelled and leaves nothing running."""
    chat = {f"q{i}": {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": f"Why page question {i}?"}],
                      "max_tokens": 8, "temperature": 0, "ignore_eos": True} for i in range(4)}

    def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})

    lines = [line(k, b) for k, b in chat.items()] + [
        "{not json", line("refused", chat["q0"] | {"temperature": "hot"}), line("other", {"prompt": "x"}, "/v1/completions")]
    upload = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    assert client.files.retrieve(upload.id).bytes == upload.bytes > 0 and upload.purpose == "batch"
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "test"})
    while batch.status not in ("completed", "failed", "cancelled"):
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    counts = batch.request_counts
    assert batch.status == "completed" and (counts.total, counts.completed, counts.failed) == (7, 4, 3)
    assert batch.metadata == {"job": "test"} and client.batches.list().data[0].id == batch.id
    for record in map(json.loads, client.files.content(batch.output_file_id).text.splitlines()):
        body = {k: v for k, v in chat[record["custom_id"]].items() if k != "ignore_eos"}
        expected = client.chat.completions.create(**body, extra_body={"ignore_eos": True})
        assert record["response"]["body"]["choices"][0]["message"]["content"] == expected.choices[0].message.content
    errors = {e["custom_id"]: e for e in map(json.loads, client.files.content(batch.error_file_id).text.splitlines())}
    assert set(errors) == {None, "refused", "other"}
    assert errors["refused"]["response"]["status_code"] == 400
    assert errors["refused"]["response"]["body"]["error"]["param"] == "temperature"
    output = batch.output_file_id
    long = [line(f"l{i}", chat["q0"] | {"max_tokens": 400}) for i in range(8)]
    upload = client.files.create(file=("long.jsonl", "\n".join(long).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    time.sleep(0.5)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    while client.batches.retrieve(batch.id).status == "cancelling":
        time.sleep(0.1)
    assert client.batches.retrieve(batch.id).status == "cancelled"
    wait_idle(server)
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)
    with pytest.raises(openai.BadRequestError):  # an output is no input
        client.batches.create(input_file_id=output, endpoint="/v1/chat/completions", completion_window="24h")


def test_message_batches_as_anthropic(server):
    """Anthropic's Message Batches API through the anthropic client: a batch created and polled until it ends; its
    results are what /v1/messages answers, a request with bad params an errored result (Anthropic's error shape);
    listed, then deleted; a canceled batch's requests not yet done come back canceled."""
    anth = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
    params = {f"q{i}": {"model": MODEL, "max_tokens": 8, "system": SYSTEM, "temperature": 0, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"Why page question {i}?"}]} for i in range(3)}
    requests = [{"custom_id": k, "params": p} for k, p in params.items()]
    requests.append({"custom_id": "bad", "params": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}})
    batch = anth.messages.batches.create(requests=requests)
    while batch.processing_status != "ended":
        time.sleep(0.2)
        batch = anth.messages.batches.retrieve(batch.id)
    assert (batch.request_counts.succeeded, batch.request_counts.errored) == (3, 1)
    results = {r.custom_id: r.result for r in anth.messages.batches.results(batch.id)}
    for custom_id, p in params.items():
        whole = anth.messages.create(**{k: v for k, v in p.items() if k not in ("temperature", "ignore_eos")},
                                     extra_body={"temperature": 0, "ignore_eos": True})
        assert results[custom_id].type == "succeeded"
        assert results[custom_id].message.content[0].text == whole.content[0].text
    assert results["bad"].type == "errored" and results["bad"].error.error.type == "invalid_request_error"
    assert anth.messages.batches.list().data[0].id == batch.id
    assert anth.messages.batches.delete(batch.id).type == "message_batch_deleted"
    long = [{"custom_id": f"l{i}", "params": params["q0"] | {"max_tokens": 400}} for i in range(8)]
    batch = anth.messages.batches.create(requests=long)
    time.sleep(0.5)
    assert anth.messages.batches.cancel(batch.id).processing_status in ("canceling", "ended")
    while anth.messages.batches.retrieve(batch.id).processing_status != "ended":
        time.sleep(0.1)
    assert anth.messages.batches.retrieve(batch.id).request_counts.canceled > 0
    wait_idle(server)
    with pytest.raises(anthropic.BadRequestError):
        anth.messages.batches.create(requests=[{"custom_id": "a b", "params": params["q0"]}])


def test_cache_salt_as_vllm(client):
    """A salted request reads only its own salt's cached prefix (usage's cached_tokens) and answers the same."""
    doc = "Salted blocks are found by their own tenant only, whatever the prompt shares. " * 6

    def chat(salt=None):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": doc}], max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {}))

    runs = [chat("s1"), chat("s1"), chat("s2"), chat(), chat()]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in runs]
    # (the first unsalted run may copy the chat template's first tokens from earlier tests' prompts)
    assert cached[0] == cached[2] == 0 and cached[1] > 0 and cached[4] > cached[3]
    assert len({r.choices[0].message.content for r in runs}) == 1
    with pytest.raises(openai.BadRequestError) as e:
        chat("")
    assert e.value.param == "cache_salt"


def test_beam_search_as_vllm(client, offline):
    """use_beam_search: n beams of the prompt as the choices, best first, the offline LLM.beam_search's; what beam
    search does not combine with is a 400 naming it."""
    from flock.beam_search import BeamSearchParams

    prompt = SYSTEM + "Beams"
    expected = offline.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.8))
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=5,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.8})
    decode = partial(offline.engine.tokenizer.decode, skip_special_tokens=True)
    assert [c.text for c in r.choices] == [decode(b.output_token_ids) for b in expected[0].sequences]
    assert all(b.text == decode(b.tokens) for b in expected[0].sequences)  # vLLM's: the prompt's text too
    assert r.usage.completion_tokens == sum(len(b.output_token_ids) for b in expected[0].sequences)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Beams"}], n=2,
                                          max_tokens=4, extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and all(c.message.content is not None for c in chat.choices)
    for extra, param in [({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"n": 11}, "n")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                      extra_body={"use_beam_search": True} | extra)
        assert e.value.param == param


def test_tokenize_and_detokenize_as_vllm(server):
    """vLLM's /tokenize (a prompt, or a chat as /v1/chat/completions templates it) and /detokenize."""
    post = lambda path, body, headers=AUTH: httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=10)  # noqa: E731
    tok = LLM("flock/tiny", load_format="dummy").get_tokenizer()
    r = post("/tokenize", {"prompt": "The cache is paged.", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("The cache is paged.") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 2048 and r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    assert post("/tokenize", {"messages": chat}).json()["tokens"] == encode_messages(tok, chat)
    text = "The cache is paged."
    assert post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": text, "content": text}  # llama.cpp's too
    bad = post("/detokenize", {"tokens": [len(tok)]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post("/tokenize", {"prompt": "x", "stream": True}).json()["error"]["param"] == "stream"
    # a chat completion's whole body counts as its prompt (a bare string among parts is text, as vLLM reads it)
    whole = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}], "max_tokens": 5,
             "tool_choice": "none", "stream": True, "tools": [{"type": "function", "function": {"name": "f"}}]}
    shown = {"messages": [{"role": "user", "content": "a\nb"}], "tools": whole["tools"]}
    assert post("/tokenize", whole).json()["tokens"] == post("/tokenize", shown).json()["tokens"]
    assert post("/tokenize", {"prompt": "x"}, headers={}).status_code == 401
    assert post("/tokenize", {"prompt": "x", "model": "other"}).status_code == 404
    assert post("/tokenize", {"prompt": "x", "return_token_strs": None}).json()["token_strs"] is None


def test_embeddings_as_openai(client, offline, server):
    """/v1/embeddings: strings (with the tokenizer's special tokens) and token ids, float and base64, equal to the
    offline LLM.embed; bad fields named (dimensions of a model that is no Matryoshka one, as vLLM)."""
    import base64

    import numpy as np

    from flock import PoolingParams

    texts = [SYSTEM + "First document.", SYSTEM + "Second document, longer than the first one."]
    r = client.embeddings.create(model=MODEL, input=texts)
    expected = [o.outputs.embedding for o in offline.embed(texts, use_tqdm=False)]
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == r.usage.total_tokens > 0
    np.testing.assert_allclose([d.embedding for d in r.data], expected, rtol=0, atol=1e-5)
    post = lambda body: httpx.post(f"{server.url}/v1/embeddings", json=body, headers=AUTH, timeout=10)  # noqa: E731
    ids = offline.get_tokenizer().encode("paged attention")
    short = post({"model": MODEL, "input": [ids], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(short["data"][0]["embedding"]), dtype="<f4")
    want = offline.embed([ids], PoolingParams(normalize=True), use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(vector, want, rtol=0, atol=1e-5)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is paged attention?"}]
    got = post({"model": MODEL, "messages": chat}).json()["data"][0]["embedding"]
    ids = encode_messages(offline.get_tokenizer(), chat, add_generation_prompt=False)
    np.testing.assert_allclose(got, offline.embed([ids], use_tqdm=False)[0].outputs.embedding, rtol=0, atol=1e-5)
    for body, param in [({"input": ""}, "input"), ({"messages": chat, "input": "x"}, "input"),
                        ({"messages": chat, "tools": []}, "tools"),
                        ({"input": "x", "dimensions": 100000}, "dimensions"), ({"input": "x", "dimensions": 8},
                                                                                "dimensions"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "x", "n": 2}, "n"),
                        ({"input": [[1, 2]] + [[100000]]}, "input")]:
        bad = post(body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (body, bad.json())


def test_score_and_rerank_as_vllm(server, offline):
    """vLLM's /v1/score and /rerank (and /score, /v1/rerank, /v2/rerank): the offline LLM.score's cosines, a rerank
    sorted by them and cut at top_n."""
    query, docs = SYSTEM + "Where is the cache?", [SYSTEM + "In blocks.", SYSTEM + "Paged.", SYSTEM + "Nowhere."]
    expected = [o.outputs.score for o in offline.score(query, docs, use_tqdm=False)]
    post = lambda path, body: httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=10)  # noqa: E731
    for path in ("/v1/score", "/score"):
        body = post(path, {"model": MODEL, "text_1": query, "text_2": docs}).json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["usage"]["prompt_tokens"] > 0
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    order = sorted(range(3), key=lambda i: -expected[i])[:2]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = post(path, {"model": MODEL, "query": query, "documents": docs, "top_n": 2}).json()
        assert [(r["index"], r["document"]["text"]) for r in body["results"]] == [(i, docs[i]) for i in order]
    bad = post("/v1/rerank", {"query": query, "documents": docs, "top_n": "2"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_n"
    assert httpx.post(f"{server.url}/v1/score", json={"text_1": "a", "text_2": "b"}, timeout=10).status_code == 401


@pytest.mark.parametrize("chat", [False, True])
def test_return_token_ids_and_truncation_as_vllm(client, chat):
    """return_token_ids: the prompt's ids (a chat's at the top level) and each choice's output ids, whole and
    streamed (the prompt's in the first chunk); truncate_prompt_tokens keeps the prompt's last tokens."""
    prompt = "The cache is paged and shared by prefix."
    kw = dict(model=MODEL, max_tokens=5, **GREEDY)
    extra = {"return_token_ids": True, "ignore_eos": True}
    if chat:
        create, kw["messages"] = client.chat.completions.create, [{"role": "user", "content": prompt}]
    else:
        create, kw["prompt"] = client.completions.create, prompt
    whole = create(**kw | {"extra_body": extra}).model_dump()
    prompt_ids = whole["prompt_token_ids"] if chat else whole["choices"][0]["prompt_token_ids"]
    assert len(prompt_ids) == whole["usage"]["prompt_tokens"] and len(whole["choices"][0]["token_ids"]) == 5
    chunks = [c.model_dump() for c in create(stream=True, **kw | {"extra_body": extra})]
    first = chunks[0] if chat else chunks[0]["choices"][0]
    assert first["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == whole["choices"][0]["token_ids"]
    with pytest.raises(openai.BadRequestError) as e:
        create(**kw | {"extra_body": extra | {"truncate_prompt_tokens": 100_000}})
    assert e.value.param == "truncate_prompt_tokens"
    cut = create(**kw | {"extra_body": extra | {"truncate_prompt_tokens": 3}}).model_dump()
    assert cut["usage"]["prompt_tokens"] == 3
    assert (cut["prompt_token_ids"] if chat else cut["choices"][0]["prompt_token_ids"]) == prompt_ids[-3:]


def test_sglang_generate(server, client):
    """SGLang's native /generate: one prompt answers an object, a batch with n a list (prompt-major); text without
    the stop, output_ids with it; streamed events carry the text so far; logprob triples; prefill only; errors."""
    post = lambda body: httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=60)  # noqa: E731
    prompt = "The cache is paged and shared by prefix."
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    one = post({"text": prompt, "sampling_params": greedy, "rid": "r1"}).json()
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY).choices[0].text
    assert one["text"] == same and len(one["output_ids"]) == 8 and one["meta_info"]["id"] == "r1"
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8} and meta["completion_tokens"] == 8
    ids = LLM("flock/tiny", load_format="dummy").get_tokenizer().encode(prompt)
    assert post({"input_ids": ids, "sampling_params": greedy}).json()["text"] == same
    batch = post({"text": [prompt, "Other"], "sampling_params": greedy | {"n": 2}}).json()
    assert [b["text"] for b in batch[:2]] == [same, same] and len(batch) == 4
    events = [line[6:] for line in httpx.post(f"{server.url}/generate", headers=AUTH, timeout=60, json={
        "text": prompt, "sampling_params": greedy, "stream": True}).text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == same
    assert all(same.startswith(json.loads(e)["text"]) for e in events[:-1])
    stop = same[3:6]
    stopped = post({"text": prompt, "sampling_params": greedy | {"stop": stop}}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == same[: same.index(stop)]
    scored = post({"text": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                   "logprob_start_len": 0, "top_logprobs_num": 2}).json()
    assert scored["text"] == "" and scored["output_ids"] == [] and scored["meta_info"]["completion_tokens"] == 0
    prompt_lp = scored["meta_info"]["input_token_logprobs"]
    assert len(prompt_lp) == len(ids) and prompt_lp[0][0] is None and all(lp < 0 for lp, _, _ in prompt_lp[1:])
    assert [t for _, t, _ in prompt_lp] == ids and len(scored["meta_info"]["input_top_logprobs"][1]) == 2
    long = post({"input_ids": ids, "sampling_params": {"max_new_tokens": 2048 - len(ids)}})
    assert long.status_code == 400 and "maximum context length of 2048" in long.json()["error"]["message"]
    filled = post({"input_ids": [5] * 2040, "sampling_params": {"max_new_tokens": None, "temperature": 0,
                                                                 "ignore_eos": True}, "return_logprob": None}).json()
    assert filled["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    keyed = [post({"text": prompt * 4, "sampling_params": greedy, "extra_key": key}).json()["meta_info"]
             for key in ("k1", "k2", "k2")]  # a key's cached prefix is its own (the priority ignored, as by SGLang)
    assert [m["cached_tokens"] > 0 for m in keyed] == [False, False, True]
    assert post({"text": prompt, "sampling_params": greedy, "priority": 5}).status_code == 200
    for bad in ({"text": prompt, "input_ids": ids}, {"text": prompt, "sampling_params": {"seed": 1}},
                {"text": prompt, "sampling_params": {"top_k": 0}}, {"text": prompt, "image_data": "x.png"},
                {"text": prompt, "sampling_params": {"n": 200}}, {"text": [prompt, "b"], "rid": ["a", "a"]}):
        r = post(bad)
        assert r.status_code == 400 and r.json()["error"]["message"]
    # SGLang's own fields at their defaults, and fields it does not know, are ignored as SGLang ignores them
    named = post({"text": [prompt, "b"], "rid": ["x", "y"], "sampling_params": greedy, "lora_path": None,
                  "model": "anything"}).json()
    assert [o["meta_info"]["id"] for o in named] == ["x", "y"] and named[0]["text"] == same
    info = httpx.get(f"{server.url}/get_model_info", headers=AUTH, timeout=10).json()
    assert info["is_generation"] is True and info["model_path"] == MODEL


def test_llama_cpp_completion(server, client):
    """llama-server's native /completion: an object for one prompt, a list for several or n_cmpl; the stop type and
    word; streamed pieces then the final object (no [DONE]); probabilities; samplers it lacks refused; its
    /tokenize, /detokenize, /apply-template and /props."""
    post = lambda path, body: httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)  # noqa: E731
    prompt = "The cache is paged and shared by prefix."
    greedy = {"temperature": 0, "n_predict": 8, "ignore_eos": True}
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY).choices[0].text
    one = post("/completion", {"prompt": prompt, **greedy, "return_tokens": True}).json()
    assert one["content"] == same and len(one["tokens"]) == one["tokens_predicted"] == 8 and one["stop"] is True
    assert one["stop_type"] == "limit" and one["stopping_word"] == "" and one["model"] == MODEL
    assert one["tokens_evaluated"] > 0 and one["timings"]["predicted_n"] == 8 and "completion_probabilities" not in one
    ids = post("/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]
    assert post("/completion", {"prompt": ids, **greedy}).json()["content"] == same
    detok = post("/detokenize", {"tokens": ids}).json()
    assert detok["content"] == detok["prompt"] and prompt in detok["content"]
    mixed = post("/completions", {"prompt": [ids[0], prompt[:3]], **greedy}).json()
    assert isinstance(mixed, dict) and mixed["tokens_evaluated"] >= 2
    several = post("/completion", {"prompt": [prompt, ids], **greedy, "n_cmpl": 2}).json()
    assert [c["content"] for c in several] == [same] * 4 and [c["index"] for c in several] == [0, 1, 2, 3]
    stop = same[3:6]
    word = post("/completion", {"prompt": prompt, **greedy, "stop": [stop]}).json()
    assert word["stop_type"] == "word" and word["stopping_word"] == stop and word["content"] == same[: same.index(stop)]
    events = [json.loads(line[6:]) for line in httpx.post(f"{server.url}/completion", headers=AUTH, timeout=60, json={
        "prompt": prompt, **greedy, "stream": True, "n_probs": 2}).text.split("\n\n") if line]
    assert "".join(e["content"] for e in events) == same and events[-1]["stop"] and not any(
        e["stop"] for e in events[:-1])
    pieces = [p for e in events[:-1] for p in e["completion_probabilities"]]
    assert len(pieces) == 8 and all(len(p["top_logprobs"]) == 2 and p["logprob"] <= 0 for p in pieces)
    probs = post("/completion", {"prompt": prompt, **greedy, "n_probs": 3, "post_sampling_probs": True,
                                 "response_fields": ["content", "generation_settings/n_predict",
                                                     "completion_probabilities"]}).json()
    assert set(probs) == {"content", "n_predict", "completion_probabilities"} and probs["n_predict"] == 8
    assert all(p["prob"] == 1 and [t["id"] for t in p["top_probs"]] == [p["id"]]  # greedy: the chosen token alone
               for p in probs["completion_probabilities"])
    chained = post("/completion", {"prompt": prompt, "n_predict": 4, "seed": 3, "top_k": 2, "temperature": 1,
                                   "min_p": 0, "top_p": 1, "n_probs": 3, "post_sampling_probs": True}).json()
    for p in chained["completion_probabilities"]:  # what top-k left, renormalized
        assert len(p["top_probs"]) == 2 and sum(t["prob"] for t in p["top_probs"]) == pytest.approx(1, abs=1e-5)
        assert p["prob"] == next(t["prob"] for t in p["top_probs"] if t["id"] == p["id"])
    # OpenAI's names for n_predict, n_cmpl and n_probs, and nulls for defaults, as llama-server takes them
    aliased = post("/completion", {"prompt": prompt, "temperature": 0, "ignore_eos": True, "max_tokens": 3,
                                   "logprobs": 2, "n": 2, "seed": None, "stream": None}).json()
    assert [c["tokens_predicted"] for c in aliased] == [3, 3] and aliased[0]["content"] == same[: len(
        aliased[0]["content"])] and len(aliased[0]["completion_probabilities"][0]["top_logprobs"]) == 2
    full = post("/completion", {"prompt": [5] * 2040, "n_predict": 100, "temperature": 0, "ignore_eos": True}).json()
    assert full["tokens_predicted"] == 8 and full["stop_type"] == "limit" and full["truncated"] is True
    assert one["truncated"] is False
    sampled = post("/completion", {"prompt": prompt, "n_predict": 6, "seed": 5, "repeat_penalty": 1.3,
                                   "samplers": ["penalties", "top_k", "temperature"]}).json()
    again = post("/completion", {"prompt": prompt, "n_predict": 6, "seed": 5, "repeat_penalty": 1.3,
                                 "samplers": "ekt"}).json()
    assert sampled["content"] == again["content"] and sampled["generation_settings"]["samplers"] == [
        "penalties", "top_k", "temperature"]
    assert post("/completion", {"prompt": prompt, "n_predict": 0}).json()["tokens_predicted"] == 0
    for bad in ({"prompt": prompt, "mirostat": 3}, {"prompt": prompt, "dry_sequence_breakers": []}, {"prompt": []},
                {"prompt": prompt, "samplers": ["top_k", "warp"]}, {"prompt": prompt, "n_predict": -2},
                {"prompt": prompt, "grammar": "root ::= x", "json_schema": {}}, {"prompt": [10 ** 9]}):
        r = post("/completion", bad)
        assert r.status_code == 400 and r.json()["error"]["message"], bad
    digits = post("/completion", {"prompt": prompt, "n_predict": 12, "temperature": 0, "grammar": 'root ::= [0-9]+'})
    assert digits.json()["content"].isdigit()
    pieces = post("/tokenize", {"content": prompt, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids[len(ids) - len(pieces):]
    llama = post("/tokenize", {"content": "🦙 á", "with_pieces": True}).json()["tokens"]  # pieces of characters
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in llama) == \
        "🦙 á".encode() and any(isinstance(p["piece"], list) for p in llama)
    tok = LLM("flock/tiny", load_format="dummy").get_tokenizer()
    assert post("/tokenize", {"content": tok.eos_token}).json()["tokens"] == [tok.eos_token_id]
    assert post("/tokenize", {"content": tok.eos_token, "parse_special": False}).json()["tokens"] == tok.encode(
        tok.eos_token, add_special_tokens=False, split_special_tokens=True) != [tok.eos_token_id]
    chat = post("/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}).json()["prompt"]
    assert "Hi" in chat
    props = httpx.get(f"{server.url}/props", headers=AUTH, timeout=10).json()
    assert props["default_generation_settings"]["n_ctx"] == 2048 and props["total_slots"] >= 1


def test_200_streams_a_fifth_disconnecting_leak_nothing(server, client):
    aborted_before = metrics(server).get("flock_requests_finished_total{reason=abort}", 0.0)

    async def one(http: httpx.AsyncClient, i: int):
        leaves = i % 5 == 0
        body = {"model": MODEL, "prompt": SYSTEM + f"Question number {i}?", "stream": True, "temperature": 0,
                "ignore_eos": True, "max_tokens": 1000 if leaves else 8}
        chunks = 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return chunks
                chunks += 1
                if leaves and chunks == 1 + i % 2:
                    return "left"  # closing the unread response drops the connection
        raise AssertionError("the stream ended without [DONE]")

    async def burst():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(200)))

    results = asyncio.run(burst())
    assert results.count("left") == 40
    assert all(isinstance(n, int) and 1 <= n <= 8 for i, n in enumerate(results) if i % 5)
    h = wait_idle(server)
    assert h["status"] == "ok" and h["kv_blocks_total"] == 1024
    assert h["attention"].split()[0] in BACKENDS
    assert metrics(server)["flock_requests_finished_total{reason=abort}"] - aborted_before == 40
    r = client.completions.create(model=MODEL, prompt="still there?", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3


@pytest.mark.parametrize("n,stream", [(1, False), (3, False), (2, True)])
def test_request_is_aborted_when_its_client_leaves(server, n, stream):
    wait_idle(server)  # an earlier test's aborts are counted before this one's
    aborted_before = metrics(server).get("flock_requests_finished_total{reason=abort}", 0.0)
    body = {"model": MODEL, "prompt": ["a very long answer", "another"][: 1 + stream], "max_tokens": 2000,
            "ignore_eos": True, "n": n, "stream": stream}
    if stream:  # the client reads one chunk and closes the connection
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=10) as r:
            next(r.iter_lines())
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(10, read=0.5))
    wait_idle(server)  # all of the request's engine requests are aborted
    assert metrics(server)["flock_requests_finished_total{reason=abort}"] - aborted_before == n * (1 + stream)


def test_metrics(server, client):
    for _ in range(2):  # the second reads the first's prefix from the cache
        client.completions.create(model=MODEL, prompt=SYSTEM + "count me", max_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", n=0)
    m = metrics(server)
    assert m["flock_http_requests_total{endpoint=/v1/completions,status=200}"] >= 1
    assert m["flock_http_requests_total{endpoint=/v1/completions,status=400}"] >= 1
    assert m["flock_prompt_tokens_total"] > 0 and m["flock_generation_tokens_total"] >= 2
    assert m["flock_time_to_first_token_seconds_count"] >= 1
    assert m["flock_kv_blocks_total"] == 1024 and m["flock_kv_blocks_used"] == 0
    assert m["flock_num_requests_waiting"] == m["flock_num_requests_running"] == 0
    assert 0 <= m["flock_prefix_saving_rate"] < 1
    # vLLM's names for the same, as its dashboards and autoscalers read them
    v = {}
    for name, value in m.items():
        if name.startswith("vllm:"):
            base, _, labels = name.rstrip("}").partition("{")
            kept = [x for x in labels.split(",") if x not in ("engine=0", f"model_name={MODEL}")]
            assert len(kept) + 2 == len(labels.split(","))  # every vLLM series names the model and engine 0
            v[base + (f"{{{','.join(kept)}}}" if kept else "")] = value
    assert v["vllm:num_requests_running"] == v["vllm:num_requests_waiting"] == v["vllm:kv_cache_usage_perc"] == 0
    assert v["vllm:generation_tokens_total"] == m["flock_generation_tokens_total"]
    assert v["vllm:request_success_total{finished_reason=length}"] >= 1
    assert v["vllm:prefix_cache_queries_total"] >= v["vllm:prefix_cache_hits_total"] > 0
    assert v["vllm:prompt_tokens_total"] >= v["vllm:prefix_cache_queries_total"]  # prompt logprobs look nothing up
    assert v["vllm:time_to_first_token_seconds_count"] == m["flock_time_to_first_token_seconds_count"]
    assert v["vllm:inter_token_latency_seconds_count"] > 0 and v["vllm:e2e_request_latency_seconds_count"] > 0
    assert v["vllm:request_generation_tokens_sum"] > 0 and v["vllm:num_preemptions_total"] >= 0
    assert v["vllm:request_time_per_output_token_seconds_count"] > 0
    # each finished request's phases (the 400 never reached the engine)
    finished = v["vllm:e2e_request_latency_seconds_count"]
    for phase in ("queue", "prefill", "decode", "inference"):
        assert v[f"vllm:request_{phase}_time_seconds_count"] == finished
    assert v["vllm:request_prefill_time_seconds_sum"] > 0
    assert v["vllm:request_inference_time_seconds_sum"] == pytest.approx(
        v["vllm:request_prefill_time_seconds_sum"] + v["vllm:request_decode_time_seconds_sum"])
    assert v["vllm:request_num_preemptions_count"] == finished and v["vllm:request_num_preemptions_sum"] == 0
    assert v["vllm:prompt_tokens_cached_total"] == v["vllm:prefix_cache_hits_total"]
    # finished requests' computed prompt tokens; streams their clients left count their prompt, never finish here
    assert v["vllm:request_prefill_kv_computed_tokens_count"] == finished
    assert 0 < v["vllm:request_prefill_kv_computed_tokens_sum"] <= (
        v["vllm:prompt_tokens_total"] - v["vllm:prompt_tokens_cached_total"])


def test_vllm_metrics_of_request_params_and_steps(server, client):
    """vLLM's parameter histograms: n once per prompt with its longest choice, max_tokens per choice (a chat
    without one: what the context leaves), and the tokens of every engine step."""
    def values() -> dict[str, float]:
        m = metrics(server)
        return {name: m.get(f"vllm:{name}{{engine=0,model_name={MODEL}}}", 0.0) for name in (
            "request_params_n_count", "request_params_n_sum", "request_params_max_tokens_count",
            "request_params_max_tokens_sum", "request_max_num_generation_tokens_count",
            "request_max_num_generation_tokens_sum", "iteration_tokens_total_count", "iteration_tokens_total_sum")}

    def chat_tokens(words: int) -> int:
        body = {"messages": [{"role": "user", "content": "hi " * words}]}
        return httpx.post(f"{server.url}/tokenize", json=body, headers=AUTH, timeout=10).json()["count"]

    per_word = chat_tokens(101) - chat_tokens(100)
    words = 100 + (2044 - chat_tokens(100)) // per_word  # a chat that leaves a few tokens of the 2,048
    wait_idle(server)
    before = values()
    r = client.completions.create(model=MODEL, prompt=["one two", "three"], n=3, max_tokens=4, temperature=1.0,
                                  seed=1, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * words}], **GREEDY)
    wait_idle(server)
    d = {k: v - before[k] for k, v in values().items()}
    chat_allowance = 2048 - chat.usage.prompt_tokens
    assert chat.usage.completion_tokens == chat_allowance <= 16
    assert d["request_params_n_count"] == 3 and d["request_params_n_sum"] == 3 + 3 + 1
    assert d["request_params_max_tokens_count"] == 7 and d["request_params_max_tokens_sum"] == 6 * 4 + chat_allowance
    assert d["request_max_num_generation_tokens_count"] == 3
    assert d["request_max_num_generation_tokens_sum"] == 4 + 4 + chat.usage.completion_tokens
    computed = r.usage.total_tokens + chat.usage.total_tokens
    assert 0 < d["iteration_tokens_total_count"] and d["iteration_tokens_total_sum"] <= computed
