"""Batch jobs in process: bad lines become error records (once), input formats, defaults, resume."""

import gzip
import json
from functools import partial

import pytest

from flock.api.batch import JobConfig, run_job
from flock.api.protocol import encode_messages
from flock.config import EngineConfig
from flock.engine.engine import LLMEngine

MAX_LEN = 64


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig.from_kwargs(model="flock/tiny", max_model_len=MAX_LEN, attention="torch",
                                              block_size=8, kv_cache_memory_bytes=64 << 20))


def batch(cid, body, url="/v1/completions", **extra):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body} | extra)


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(engine, tmp_path, inp, **kw) -> int:
    return run_job(JobConfig(str(inp), str(tmp_path / "out.jsonl"), quiet=True, **kw), engine)


def test_bad_lines_become_error_records_once(engine, tmp_path, capsys):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    lines = [
        batch("good-1", {"prompt": "The cache is paged.", "max_tokens": 3}),  # 1
        "{not json",  # 2
        "[1, 2]",  # 3
        batch("good-2", chat, "/v1/chat/completions"),  # 4
        batch("bad-url", {"prompt": "x"}, "/v1/images/generations"),  # 5
        batch("bad-method", {"prompt": "x"}, method="GET"),  # 6
        batch("extra", {"prompt": "x", "max_tokens": 1}, metadata={"a": 1}),  # 7: ignored, as vLLM ignores it
        batch("bad-field", {"prompt": "x", "functions": [{"name": "f"}]}),  # 8
        batch("bad-param", {"prompt": "x", "max_tokens": 0}),  # 9
        "",  # 10
        batch("bad-long", {"prompt": [5] * (MAX_LEN + 1)}),  # 11
        batch("bad-vocab", {"prompt": [5, 99999]}),  # 12
        batch("good-1", {"prompt": "again"}),  # 13
        json.dumps({"prompt": "hi", "max_tokens": 2}),  # 14
        json.dumps({"text": "no prompt"}),  # 15
        batch("bad-stream", {"prompt": "x", "stream": True}),  # 16
        batch(7, {"prompt": "x"}),  # 17
        json.dumps({"prompt_token_ids": [-1, 5]}),  # 18
        json.dumps(chat),  # 19
        batch("bad-unicode", {"prompt": "hi \ud800"}),  # 20
        json.dumps({"custom_id": "x\ud800", "prompt": "x"}),  # 21
        json.dumps(chat | {"prompt": "x"}),  # 22
        batch("bad-method", {"prompt": "x"}),  # 23: its id was claimed by line 6, a bad line
        batch("bad-seed", {"prompt": "x", "seed": 2**64}),  # 24
    ]
    inp = tmp_path / "mixed.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert run(engine, tmp_path, inp) == 0  # a completed batch, failed lines and all (as OpenAI's Batch API)
    out, err = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    assert sorted(r["custom_id"] for r in records(out)) == ["extra", "good-1", "good-2", "line-14", "line-19"]
    errors = {r["error"]["line"]: r for r in records(err)}
    expected = {2: None, 3: None, 5: "bad-url", 6: "bad-method", 8: "bad-field", 9: "bad-param",
                11: "bad-long", 12: "bad-vocab", 13: "good-1", 15: "line-15", 16: "bad-stream", 17: None,
                18: "line-18", 20: "bad-unicode", 21: None, 22: "line-22", 23: "bad-method", 24: "bad-seed"}
    assert len(records(err)) == len(expected)
    assert {n: r["custom_id"] for n, r in errors.items()} == expected
    for n, r in errors.items():
        assert r["response"] is None and r["id"].startswith("batch_req_")
        assert r["error"]["message"].startswith(f"line {n}: ")
    assert errors[2]["error"]["code"] == "invalid_json" and errors[13]["error"]["code"] == "duplicate_custom_id"
    assert errors[23]["error"]["code"] == "duplicate_custom_id" and "surrogate" in errors[21]["error"]["message"]
    assert [errors[n]["error"]["param"] for n in (8, 9, 22, 24)] == ["functions", "max_tokens", "messages", "seed"]
    assert "max_model_len" in errors[11]["error"]["message"] and "vocabulary" in errors[12]["error"]["message"]
    _, stderr = capsys.readouterr()
    assert f"18 line(s) failed (18 newly reported); see {err}" in stderr

    before = out.read_bytes(), err.read_bytes()
    assert run(engine, tmp_path, inp, resume=True, strict=True) == 1  # --strict: any failed line is fatal
    assert (out.read_bytes(), err.read_bytes()) == before
    stdout, stderr = capsys.readouterr()
    assert "0 succeeded, 18 failed, 5 skipped" in stdout and "(0 newly reported)" in stderr


def test_gzip_plain_lines_chat_and_defaults(engine, tmp_path):
    tok = engine.tokenizer
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    lines = [
        {"prompt": "a b c", "max_tokens": 2, "ignore_eos": True},
        {"prompt_token_ids": [5, 6, 7], "ignore_eos": True},  # --max-tokens default
        {"messages": msgs, "max_tokens": 3, "ignore_eos": True},
        {"prompt": "x", "custom_id": "mine", "temperature": 0.5, "seed": 1, "max_tokens": 2},
    ]
    inp = tmp_path / "in.jsonl.gz"
    with gzip.open(inp, "wt") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    assert run(engine, tmp_path, inp, max_tokens=5, sampling={"temperature": 0.0}) == 0
    got = {r["custom_id"]: r["response"]["body"] for r in records(tmp_path / "out.jsonl")}
    assert sorted(got) == ["line-1", "line-2", "line-3", "mine"]
    assert [got[c]["usage"]["completion_tokens"] for c in ("line-1", "line-2", "line-3")] == [2, 5, 3]
    assert got["line-1"]["usage"]["prompt_tokens"] == len(tok.encode("a b c", add_special_tokens=True))
    assert got["line-2"]["usage"]["prompt_tokens"] == 3
    chat = got["line-3"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["prompt_tokens"] == len(encode_messages(tok, msgs))
    assert got["line-1"]["object"] == "text_completion" and got["line-1"]["model"] == "flock/tiny"
    for body in got.values():
        assert body["id"].startswith(("cmpl-", "chatcmpl-"))
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert not (tmp_path / "out.errors.jsonl").exists()


def test_openai_defaults_without_flags(engine, tmp_path):
    """No CLI default: a completion gets 16 tokens, a chat runs to max_model_len."""
    msgs = [{"role": "user", "content": "a long question " * 9}]
    inp = tmp_path / "in.jsonl"
    greedy = {"ignore_eos": True, "temperature": 0}
    inp.write_text(batch("c", {"prompt": "hi"} | greedy) + "\n"
                   + batch("m", {"messages": msgs} | greedy, "/v1/chat/completions") + "\n")
    assert run(engine, tmp_path, inp, overwrite=True) == 0
    got = {r["custom_id"]: r["response"]["body"]["usage"] for r in records(tmp_path / "out.jsonl")}
    assert got["c"]["completion_tokens"] == 16
    assert got["m"]["prompt_tokens"] == len(encode_messages(engine.tokenizer, msgs))
    assert got["m"]["total_tokens"] == MAX_LEN


def test_existing_output_needs_resume_or_overwrite(engine, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi", "max_tokens": 1}) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("")
    assert run(engine, tmp_path, inp) == 2
    assert "already exists" in capsys.readouterr().err and out.read_text() == ""
    (tmp_path / "out.errors.jsonl").write_text("")
    out.unlink()
    assert run(engine, tmp_path, inp) == 2  # the error file alone marks a started job too
    assert run(engine, tmp_path, inp, overwrite=True) == 0
    assert [r["custom_id"] for r in records(out)] == ["line-1"] and not (tmp_path / "out.errors.jsonl").exists()


def test_overwrite_keeps_the_old_results_of_a_job_that_cannot_start(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi", "max_tokens": 1}) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "old"}\n')
    cfg = JobConfig(str(inp), str(out), quiet=True, overwrite=True, engine={"model": str(tmp_path / "no-model")})
    assert run_job(cfg) == 2 and out.read_text() == '{"custom_id": "old"}\n'
    assert "no-model" in capsys.readouterr().err


def test_null_fields_take_the_flags_and_vllms_urls(engine, tmp_path):
    """A body's null field is unset: the job's flags apply (as the model's defaults do); vLLM's /score, /rerank
    and /v2/rerank urls; a whole number sent as a float, 0 / 1 as booleans (vLLM's lax JSON)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    lines = [batch("null", chat | {"max_tokens": None, "temperature": None}, "/v1/chat/completions"),
             batch("float", chat | {"max_tokens": 2.0, "logprobs": 1}, "/v1/chat/completions"),
             batch("score", {"text_1": "a", "text_2": ["b", "c"]}, "/score"),
             batch("rerank", {"query": "a", "documents": ["b", "c"]}, "/v2/rerank")]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert run(engine, tmp_path, inp, max_tokens=3, sampling={"temperature": 0}) == 0
    got = {r["custom_id"]: r["response"]["body"] for r in records(tmp_path / "out.jsonl")}
    assert got["null"]["usage"]["completion_tokens"] == 3
    assert got["float"]["usage"]["completion_tokens"] == 2 and got["float"]["choices"][0]["logprobs"]["content"]
    assert len(got["score"]["data"]) == 2 and len(got["rerank"]["results"]) == 2


def test_resuming_an_edited_input_reports_its_new_bad_lines(engine, tmp_path):
    """A bad line is known by its number and custom_id: after an edit another bad line at that number is
    reported, and the old one fixed runs."""
    good = lambda cid: batch(cid, {"prompt": "x", "max_tokens": 1})  # noqa: E731
    bad = lambda cid: batch(cid, {"prompt": "x", "max_tokens": 0})  # noqa: E731
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([good("a"), bad("b"), good("z")]) + "\n")
    assert run(engine, tmp_path, inp) == 0
    inp.write_text("\n".join([good("a"), bad("c"), good("b"), good("z")]) + "\n")
    assert run(engine, tmp_path, inp, resume=True) == 0
    errors = records(tmp_path / "out.errors.jsonl")
    assert [(r["custom_id"], r["error"]["line"]) for r in errors] == [("b", 2), ("c", 2)]
    assert sorted(r["custom_id"] for r in records(tmp_path / "out.jsonl")) == ["a", "b", "z"]
    inp.write_text("\n".join([good("a"), good("c"), good("b"), good("z")]) + "\n")  # line 2 fixed where it is
    assert run(engine, tmp_path, inp, resume=True) == 0
    errors = records(tmp_path / "out.errors.jsonl")  # one record per line: c's error left with its success
    assert [(r["custom_id"], r["error"]["line"]) for r in errors] == [("b", 2)]
    assert sorted(r["custom_id"] for r in records(tmp_path / "out.jsonl")) == ["a", "b", "c", "z"]


def test_summary_shows_answers_spread_over_the_input(engine, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"q{i}", "prompt": f"question {i}", "max_tokens": 3,
                                       "temperature": 0}) + "\n" for i in range(20)))
    assert run_job(JobConfig(str(inp), str(tmp_path / "out.jsonl")), engine) == 0
    out, err = capsys.readouterr()
    # stderr is no terminal here: the progress comes as lines (as vLLM's run-batch writes them into a log)
    assert "flock run: 20/20 req [" in err and "flock run: reading" in err
    answers = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in records(tmp_path / "out.jsonl")}
    shown = out.split("answers (8 of 20, all in ")[1].splitlines()[1:]
    assert [line.split()[0] for line in shown] == ["q0", "q2", "q5", "q7", "q10", "q12", "q15", "q17"]
    assert all(" ".join(answers[line.split()[0]].split()) in line for line in shown)
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"prompt": f"question {i}", "max_tokens": 2}) + "\n" for i in range(3)))
    assert run_job(JobConfig(str(few), str(tmp_path / "few.out.jsonl")), engine) == 0
    assert "answers (3 of 3, all in " in capsys.readouterr().out


def test_missing_output_folder_is_refused_before_the_model_loads(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n")
    unbuilt = lambda: pytest.fail("the engine was built")  # noqa: E731
    assert run_job(JobConfig(str(inp), str(tmp_path / "no" / "out.jsonl")), build_engine=unbuilt) == 2
    assert "no such directory" in capsys.readouterr().err


def test_n_and_prompt_lists_make_one_record_per_line(engine, tmp_path):
    a, b = "The pool hands out blocks", "A scheduler plans steps"
    sampled = {"temperature": 1, "max_tokens": 6, "ignore_eos": True}
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    lines = [batch("seed-3", {"prompt": a, "seed": 3} | sampled), batch("seed-4", {"prompt": a, "seed": 4} | sampled),
             batch("n2", {"prompt": a, "seed": 3, "n": 2} | sampled),
             batch("a", {"prompt": a} | greedy), batch("b", {"prompt": b} | greedy),
             batch("list", {"prompt": [a, b]} | greedy),
             batch("chat", {"messages": [{"role": "user", "content": b}], "n": 2} | greedy, "/v1/chat/completions")]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert run(engine, tmp_path, inp) == 0
    got = {r["custom_id"]: r["response"]["body"] for r in records(tmp_path / "out.jsonl")}
    assert len(records(tmp_path / "out.jsonl")) == len(lines)
    texts = {cid: [c["text"] if "text" in c else c["message"]["content"] for c in body["choices"]]
             for cid, body in got.items()}
    assert texts["n2"] == texts["seed-3"] + texts["seed-4"] and texts["seed-3"] != texts["seed-4"]
    assert texts["list"] == texts["a"] + texts["b"]
    assert len(texts["chat"]) == 2 and texts["chat"][0] == texts["chat"][1]
    assert [c["index"] for c in got["list"]["choices"]] == [0, 1]
    usage = {cid: body["usage"] for cid, body in got.items()}
    assert usage["n2"]["prompt_tokens"] == usage["seed-3"]["prompt_tokens"]  # one prompt, counted once
    assert usage["n2"]["completion_tokens"] == 12
    assert usage["list"]["prompt_tokens"] == usage["a"]["prompt_tokens"] + usage["b"]["prompt_tokens"]


def test_samples_of_a_prompt_share_its_full_blocks(engine, tmp_path):
    ids = list(range(100, 130))  # 30 tokens: 3 full blocks of 8 and 6 more, seen by no earlier test
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch("n3", {"prompt": ids, "n": 3, "max_tokens": 2, "ignore_eos": True}) + "\n")
    assert run(engine, tmp_path, inp) == 0
    s = engine.stats.as_dict()
    assert s["logical_prefill_tokens"] == 3 * len(ids)
    assert s["computed_prefill_tokens"] == len(ids) + 2 * (len(ids) - 24)  # the copies compute only the tail


def test_structured_and_logprob_lines(engine, tmp_path):
    """json_schema lines give schema-valid records; a schema the grammar engine rejects is an error record naming
    response_format; echo and logprobs come back in OpenAI's shapes; the other lines are untouched."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    bad = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "required": 5}}}
    chat = lambda **kw: {"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 20} | kw
    lines = [batch(f"json-{i}", chat(response_format=fmt, seed=i, temperature=1), "/v1/chat/completions")
             for i in range(6)]
    lines += [batch("bad-schema", chat(response_format=bad), "/v1/chat/completions"),
              batch("lp", {"prompt": [5, 6, 7, 8], "max_tokens": 2, "logprobs": 2, "echo": True, "temperature": 0}),
              batch("plain", chat(), "/v1/chat/completions")]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert run(engine, tmp_path, inp) == 0
    out = {r["custom_id"]: r["response"]["body"] for r in records(tmp_path / "out.jsonl")}
    for i in range(6):
        choice = out[f"json-{i}"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    lp = out["lp"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and lp["token_logprobs"][0] is None and all(x < 0 for x in lp["token_logprobs"][1:])
    assert "plain" in out
    (error,) = records(tmp_path / "out.errors.jsonl")
    assert error["custom_id"] == "bad-schema" and error["error"]["param"] == "response_format"
    assert "rejected by the grammar engine" in error["error"]["message"]


@pytest.mark.parametrize("parser", ["llama3_json", "pythonic"])
def test_tool_call_lines(engine, tmp_path, parser):
    """With a tool-call parser a named function's call comes back in tool_calls, following its schema; without
    one the line is an error record naming tool_choice (tool_choice 'none' still works)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
    chat = lambda choice: {"messages": [{"role": "user", "content": "Call f."}], "tools": [tool],  # noqa: E731
                           "tool_choice": choice, "max_tokens": 40, "temperature": 0}
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch("named", chat({"type": "function", "function": {"name": "f"}}), "/v1/chat/completions")
                   + "\n" + batch("none", chat("none"), "/v1/chat/completions") + "\n")
    assert run(engine, tmp_path, inp, tool_parser=parser) == 0
    out = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in records(tmp_path / "out.jsonl")}
    (call,) = out["named"]["message"]["tool_calls"]
    assert call["function"]["name"] == "f" and isinstance(json.loads(call["function"]["arguments"])["ok"], bool)
    assert out["named"]["message"]["content"] == "" and out["named"]["finish_reason"] == "stop"
    assert "tool_calls" not in out["none"]["message"]
    assert run(engine, tmp_path, inp, overwrite=True) == 0
    (error,) = records(tmp_path / "out.errors.jsonl")
    assert (error["custom_id"], error["error"]["param"]) == ("named", "tool_choice")


def test_embedding_lines_beside_completions(engine, tmp_path):
    """/v1/embeddings lines (vLLM's run-batch takes them): one record each, as the server's response; a bad one
    becomes an error record naming its field (dimensions of a model that is no Matryoshka one, as vLLM); the
    completions beside them are unchanged."""
    doc = "The pool hands out blocks"
    lines = [batch("e", {"input": [doc, "A scheduler plans steps"]}, "/v1/embeddings"),
             batch("short", {"input": doc, "dimensions": 4}, "/v1/embeddings"),
             batch("bad", {"input": doc, "dimensions": 0}, "/v1/embeddings"),
             batch("c", {"prompt": doc, "max_tokens": 3, "temperature": 0, "ignore_eos": True})]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert run(engine, tmp_path, inp) == 0
    got = {r["custom_id"]: r["response"]["body"] for r in records(tmp_path / "out.jsonl")}
    assert set(got) == {"e", "c"} and len(got["c"]["choices"][0]["text"]) > 0
    ids = engine.tokenizer.encode(doc)
    assert [d["index"] for d in got["e"]["data"]] == [0, 1] and len(got["e"]["data"][0]["embedding"]) == 256
    assert got["e"]["usage"]["prompt_tokens"] == len(ids) + len(engine.tokenizer.encode("A scheduler plans steps"))
    errors = {e["custom_id"]: e["error"] for e in records(tmp_path / "out.errors.jsonl")}
    assert set(errors) == {"short", "bad"} and errors["bad"]["param"] == errors["short"]["param"] == "dimensions"
    assert "Matryoshka" in errors["short"]["message"]


def test_response_lines_answer_as_chat_lines(engine, tmp_path):
    """/v1/responses lines (OpenAI's Batch API takes them): a Response object each, whose message is the chat
    line's answer to the same conversation; CLI flags fill what a line leaves unset; a grammar the engine rejects
    and a previous_response_id (a job stores no responses) are error records naming the Responses field."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "name": "s", "schema": schema}
    lines = [batch("r", {"input": "Why page the cache?", "instructions": "Be brief.", "max_output_tokens": 5},
                   "/v1/responses"),
             batch("c", {"messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Why page the cache?"}], "max_tokens": 5},
                   "/v1/chat/completions"),
             batch("json", {"input": "JSON please.", "text": {"format": fmt}, "max_output_tokens": 20},
                   "/v1/responses"),
             batch("flags", {"input": "Hello"}, "/v1/responses"),
             batch("bad", {"input": "x", "text": {"format": fmt | {"schema": {"type": "object", "required": 5}}}},
                   "/v1/responses"),
             batch("next", {"input": "x", "previous_response_id": "resp_1"}, "/v1/responses")]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert run(engine, tmp_path, inp, sampling={"temperature": 0, "ignore_eos": True}, max_tokens=3) == 0
    out = {r["custom_id"]: r for r in records(tmp_path / "out.jsonl")}
    r = out["r"]["response"]["body"]
    assert r["object"] == "response" and out["r"]["response"]["request_id"] == r["id"]
    assert r["output"][0]["content"][0]["text"] == out["c"]["response"]["body"]["choices"][0]["message"]["content"]
    assert r["usage"]["output_tokens"] == 5 and r["status"] == "incomplete" and r["store"] is False
    assert json.loads(out["json"]["response"]["body"]["output"][0]["content"][0]["text"]) in ({"ok": True},
                                                                                            {"ok": False})
    assert out["flags"]["response"]["body"]["usage"]["output_tokens"] == 3
    errors = {e["custom_id"]: e["error"]["param"] for e in records(tmp_path / "out.errors.jsonl")}
    assert errors == {"bad": "text.format", "next": "previous_response_id"}


def test_message_lines_answer_as_chat_lines(engine, tmp_path):
    """/v1/messages lines, and Anthropic's Message Batches lines ({custom_id, params}): an Anthropic Message each,
    whose text is the chat line's answer to the same conversation; a stop sequence says which; a body without
    max_tokens or with a PDF is an error record naming the field."""
    user = [{"role": "user", "content": "Why page the cache?"}]
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}}
    lines = [batch("m", {"system": "Be brief.", "messages": user, "max_tokens": 8}, "/v1/messages"),
             batch("c", {"messages": [{"role": "system", "content": "Be brief."}] + user, "max_tokens": 8},
                   "/v1/chat/completions"),
             batch("no-max", {"messages": user}, "/v1/messages"),
             batch("pdf", {"messages": [{"role": "user", "content": [pdf]}], "max_tokens": 8}, "/v1/messages"),
             json.dumps({"custom_id": "anthropic", "params": {"system": "Be brief.", "messages": user,
                                                              "max_tokens": 8}}),
             json.dumps({"custom_id": "bad-anthropic", "params": "x"})]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert run(engine, tmp_path, inp, sampling={"temperature": 0, "ignore_eos": True}) == 0
    out = {r["custom_id"]: r["response"] for r in records(tmp_path / "out.jsonl")}
    m, text = out["m"]["body"], out["c"]["body"]["choices"][0]["message"]["content"]
    assert m["type"] == "message" and out["m"]["request_id"] == m["id"] and m["content"][0]["text"] == text
    assert m["stop_reason"] == "max_tokens" and m["usage"]["output_tokens"] == 8
    assert out["anthropic"]["body"]["content"] == m["content"]
    errors = {e["custom_id"]: e["error"]["param"] for e in records(tmp_path / "out.errors.jsonl")}
    assert errors == {"no-max": "max_tokens", "pdf": "messages[0].content[0].source", "bad-anthropic": "params"}
    stop = text[3:6]
    inp.write_text(batch("s", {"system": "Be brief.", "messages": user, "max_tokens": 8, "stop_sequences": [stop]},
                         "/v1/messages") + "\n")
    assert run(engine, tmp_path, inp, sampling={"temperature": 0, "ignore_eos": True}, overwrite=True) == 0
    stopped = records(tmp_path / "out.jsonl")[0]["response"]["body"]
    assert (stopped["content"][0]["text"], stopped["stop_sequence"]) == (text[: text.find(stop)], stop)


def test_score_and_rerank_lines(engine, tmp_path):
    """/v1/score and /v1/rerank lines (vLLM's run-batch takes them): the offline LLM.score's cosines; a bad one is
    an error record naming its field."""
    from flock import LLM

    docs = ["The pool hands out blocks", "A scheduler plans steps", "Rain in Paris"]
    lines = [batch("s", {"text_1": "Where do blocks come from?", "text_2": docs}, "/v1/score"),
             batch("r", {"query": "Where do blocks come from?", "documents": docs, "top_n": 1}, "/v1/rerank"),
             batch("bad", {"query": "q", "documents": []}, "/v1/rerank")]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert run(engine, tmp_path, inp) == 0
    got = {r["custom_id"]: r["response"]["body"] for r in records(tmp_path / "out.jsonl")}
    offline = LLM(engine.config.model, max_model_len=MAX_LEN, attention="torch", block_size=8, num_kv_blocks=64)
    expected = [o.outputs.score for o in offline.score("Where do blocks come from?", docs, use_tqdm=False)]
    assert [d["score"] for d in got["s"]["data"]] == pytest.approx(expected, abs=1e-5)
    best = max(range(3), key=lambda i: expected[i])
    assert [x["index"] for x in got["r"]["results"]] == [best]
    (error,) = records(tmp_path / "out.errors.jsonl")
    assert (error["custom_id"], error["error"]["param"]) == ("bad", "documents")


def test_label_score_lines(engine, tmp_path):
    """/generative_scoring lines (vLLM's body) and /v1/score lines with label_token_ids (SGLang's): the offline
    LLM.generative_score's probabilities; an item too long for the model is an error record naming items."""
    from flock import LLM

    query, items, labels = "Is the sky blue? Answer:", [" yes", " no", " maybe"], [5, 6]
    lines = [batch("v", {"query": query, "items": items, "label_token_ids": labels}, "/generative_scoring"),
             batch("s", {"query": query, "items": items, "label_token_ids": labels}, "/v1/score"),
             batch("long", {"query": "word " * MAX_LEN, "items": ["a"], "label_token_ids": [1]}, "/v1/score")]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert run(engine, tmp_path, inp) == 0
    got = {r["custom_id"]: r["response"]["body"] for r in records(tmp_path / "out.jsonl")}
    offline = LLM(engine.config.model, max_model_len=MAX_LEN, attention="torch", block_size=8, num_kv_blocks=64)
    expected = offline.generative_score(query, items, labels, use_tqdm=False)
    assert got["s"]["scores"] == [pytest.approx(e, rel=1e-3) for e in expected]
    tok = engine.tokenizer  # vLLM's way: token ids joined, the labels softmaxed, the first one's the score
    joined = offline.generative_score(tok.encode(query), [tok.encode(i, add_special_tokens=False) for i in items],
                                      labels, apply_softmax=True, use_tqdm=False)
    assert [d["score"] for d in got["v"]["data"]] == pytest.approx([p[0] for p in joined], rel=1e-3)
    (error,) = records(tmp_path / "out.errors.jsonl")
    assert (error["custom_id"], error["error"]["param"]) == ("long", "items")


def test_beam_search_lines(engine, tmp_path):
    """use_beam_search lines (vLLM's run-batch takes them): each step's requests go through the job's engine beside
    the other lines'; the record's choices are the offline LLM.beam_search's beams, best first."""
    from flock import LLM, BeamSearchParams

    lines = [batch("beams", {"prompt": ["The cache is paged", "Blocks"], "n": 2, "max_tokens": 4,
                             "use_beam_search": True, "length_penalty": 0.7}),
             batch("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 3,
                            "use_beam_search": True}, "/v1/chat/completions"),
             batch("plain", {"prompt": "The cache is paged", "max_tokens": 3, "temperature": 0}),
             batch("bad", {"prompt": "x", "use_beam_search": True, "logprobs": 1})]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert run(engine, tmp_path, inp) == 0
    got = {r["custom_id"]: r["response"]["body"] for r in records(tmp_path / "out.jsonl")}
    offline = LLM(engine.config.model, max_model_len=MAX_LEN, attention="torch", block_size=8, num_kv_blocks=64)
    expected = offline.beam_search(["The cache is paged", "Blocks"],
                                   BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.7))
    decode = partial(offline.engine.tokenizer.decode, skip_special_tokens=True)
    assert [c["text"] for c in got["beams"]["choices"]] == [decode(b.output_token_ids) for o in expected
                                                            for b in o.sequences]
    assert len(got["chat"]["choices"]) == 3 and "plain" in got
    (error,) = records(tmp_path / "out.errors.jsonl")
    assert (error["custom_id"], error["error"]["param"]) == ("bad", "logprobs")
