"""The structured-output batch benchmark's pieces that run without a model: documents, lines, scoring."""

import json

import jsonschema

from bench.harness.documents import documents
from bench.structured_batch import (QUESTIONS, batch_lines, flock_summary, progress_bar_seconds, schema_error,
                                    score)


def test_documents_are_many_sized_and_deterministic():
    docs = documents()
    assert len(docs) >= 60
    assert all(1500 <= len(text) <= 4000 for _, text in docs)
    assert len({title for title, _ in docs}) == len(docs)
    assert documents(5) == docs[:5]
    shuffled = documents(5, seed=3)
    assert shuffled == documents(5, seed=3) and shuffled != docs[:5]


def test_schemas_are_valid_and_strict():
    assert len({json.dumps(q.schema) for q in QUESTIONS}) >= 5
    for q in QUESTIONS:
        jsonschema.Draft202012Validator.check_schema(q.schema)
        assert q.schema["additionalProperties"] is False and q.schema["required"] == list(q.schema["properties"])


def test_lines_share_documents_and_order():
    docs = [("a", "x" * 10), ("b", "y" * 10)]
    structured = batch_lines(docs, QUESTIONS[:2], True, 100, seed=1, model="M")
    plain = batch_lines(docs, QUESTIONS[:2], False, 40, seed=1, model="M")
    assert [line["custom_id"] for line in structured] == [line["custom_id"] for line in plain]
    assert len(structured) == 4
    assert all(line["body"]["response_format"]["json_schema"]["strict"] for line in structured)
    assert not any("response_format" in line["body"] for line in plain)
    assert {line["body"]["messages"][0]["content"] for line in structured} == {plain[0]["body"]["messages"][0]["content"]}


def _record(cid, content, finish="stop"):
    body = {"choices": [{"message": {"content": content}, "finish_reason": finish}], "usage": {"completion_tokens": 3}}
    return {"custom_id": cid, "response": {"status_code": 200, "body": body}, "error": None}


def test_score_counts_valid_invalid_errors_and_missing():
    lines = batch_lines([("a", "text")], QUESTIONS[1:2] + QUESTIONS[5:6], True, 100, seed=0, model="M")
    ids = {line["custom_id"].split("-")[1]: line["custom_id"] for line in lines}
    records = [_record(ids["kind"], '{"kind": "tutorial", "audience": "experts"}')]
    s = score(lines + [{"custom_id": "x", "body": {}}], records + [
        {"custom_id": ids["errors"], "response": None, "error": {"message": "line 2: not supported"}},
    ], structured=True)
    c = s["counts"]
    assert (c["valid"], c["invalid"], c["errors"], c["missing"], c["stop"]) == (1, 0, 1, 1, 1)
    assert s["error_examples"] == ["line 2: not supported"]
    bad = score(lines[:1], [_record(lines[0]["custom_id"], '{"kind": 3', "length")], structured=True)["counts"]
    assert (bad["invalid"], bad["length"]) == (1, 1)


def test_schema_error():
    schema = QUESTIONS[4].schema
    assert schema_error('{"module": "json", "import_statement": "import json"}', schema) is None
    assert schema_error('{"module": "JSON", "import_statement": "import json"}', schema).startswith("schema")
    assert schema_error("nope", schema).startswith("not JSON")


def test_timings_from_the_logs():
    bar = "Running batch:  50% Completed | 6/12 [00:10<00:10]\rRunning batch: 100% Completed | 12/12 [01:02<00:00, 1req/s]"
    assert progress_bar_seconds(bar, "Running batch") == 62.0
    assert progress_bar_seconds("nothing", "Running batch") is None
    summary = flock_summary("saving rate                             66.5%\n"
                            "time: wall / model / scheduling         0.82 s / 0.81 s / 5.0 ms\n  indented  no")
    assert summary == {"saving rate": "66.5%", "time: wall / model / scheduling": "0.82 s / 0.81 s / 5.0 ms"}
