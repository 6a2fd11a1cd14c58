"""What a model folder gives requests by default, as vLLM: its generation_config.json the sampling fields a
request leaves unset (--generation-config auto: in LLM.generate without params, in flock serve bodies and in
flock run lines), and a chat template of one's own in place of the tokenizer's (--chat-template)."""

import json
import shutil

import pytest

from flock import LLM, SamplingParams
from flock.api.protocol import parse_request, with_defaults

GENERATION = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 5,
              "eos_token_id": 1}


@pytest.fixture(scope="module")
def folder(hf_folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("generation") / "qwen3"
    shutil.copytree(hf_folders["qwen3"], out)
    (out / "generation_config.json").write_text(json.dumps(GENERATION))
    return out


def test_defaults_from_the_folder(folder):
    llm = LLM(str(folder), dtype="float32")
    assert llm.engine.sampling_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 5}
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 20, 0.95, 5)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5
    assert LLM(str(folder), dtype="float32", generation_config="vllm").engine.sampling_defaults == {}
    with pytest.raises(ValueError, match="no generation_config.json there"):
        LLM(str(folder), dtype="float32", generation_config=str(folder.parent))


def test_a_body_keeps_what_it_sets(folder):
    llm = LLM(str(folder), dtype="float32")
    tok, defaults = llm.get_tokenizer(), llm.engine.sampling_defaults
    body = {"prompt": "x", "temperature": 0, "top_k": None}
    params = parse_request("completion", with_defaults(body, defaults), tok).params
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0, 20, 0.95, 5)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9}
    assert parse_request("chat", with_defaults(chat, defaults), tok).params.max_tokens == 9
    explicit = SamplingParams(temperature=0, max_tokens=3)
    assert len(llm.generate([[5, 6, 7]], explicit, use_tqdm=False)[0].outputs[0].token_ids) <= 3


def test_server_and_batch_lines_take_the_defaults(folder, tmp_path):
    """As vLLM: a served chat and a chat batch line without max_tokens stop at the folder's max_new_tokens (5), a
    completion at 16 whatever the folder says; one that sets it at its own; a `flock run` flag wins over the
    folder. The folder given as --generation-config, or override_generation_config's max_new_tokens, caps every
    request, those that set max_tokens too."""
    import asyncio

    import httpx

    from flock.api.batch import JobConfig, run_job
    from flock.api.metrics import Metrics
    from flock.api.server_app import build_app
    from flock.api.server_generate import ServerContext
    from flock.config import EngineConfig
    from flock.engine.async_engine import AsyncEngine
    from flock.engine.engine import LLMEngine

    chat = {"messages": [{"role": "user", "content": "x"}], "ignore_eos": True}
    completion = {"prompt": [5, 6], "ignore_eos": True}
    cases = [({}, [(completion, 16), (chat, 5), (completion | {"max_tokens": 8}, 8), (chat | {"max_tokens": 8}, 8)]),
             ({"generation_config": str(folder)}, [(completion | {"max_tokens": 8}, 5), (chat, 5)]),
             ({"override_generation_config": {"max_new_tokens": 3}}, [(chat | {"max_tokens": 8}, 3), (completion, 3)])]
    for options, expected in cases:
        config = EngineConfig.from_kwargs(str(folder), dtype="float32", **options)
        engine = AsyncEngine(config).start()
        try:
            app = build_app(ServerContext(engine, Metrics(engine), ["m"]))

            async def post(body):
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                    return (await http.post(path, json=body)).json()["usage"]["completion_tokens"]

            assert [asyncio.run(post(body)) for body, _ in expected] == [n for _, n in expected], options
        finally:
            engine.shutdown()
    config = EngineConfig.from_kwargs(str(folder), dtype="float32")
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "messages": chat["messages"], "ignore_eos": True}) + "\n")
    for flag, expected in ((None, 5), (7, 7)):  # flock run --max-tokens 7
        out = tmp_path / f"out{expected}.jsonl"
        assert run_job(JobConfig(str(inp), str(out), quiet=True, max_tokens=flag), LLMEngine(config)) == 0
        assert json.loads(out.read_text())["response"]["body"]["usage"]["completion_tokens"] == expected


def test_a_chat_template_of_ones_own(folder, tmp_path):
    """chat_template (vLLM's --chat-template): a Jinja template or a file holding one replaces the tokenizer's, in
    LLM.chat and in the server's own tokenizer copy; anything else is refused by name."""
    from flock.config import EngineConfig
    from flock.engine.async_engine import AsyncEngine
    from flock.tokenizer import encode_chat

    template = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    (tmp_path / "t.jinja").write_text(template)
    for given in (template, str(tmp_path / "t.jinja")):
        llm = LLM(str(folder), dtype="float32", chat_template=given)
        out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert out.prompt == "[user: hi]"
    engine = AsyncEngine(EngineConfig.from_kwargs(str(folder), dtype="float32", chat_template=template)).start()
    try:
        assert engine.tokenizer.decode(encode_chat(engine.tokenizer, messages)) == "[user: hi]"
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        LLM(str(folder), dtype="float32", chat_template=str(tmp_path / "missing.jinja"))
