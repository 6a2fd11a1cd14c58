"""OpenAI's Files and Batch APIs without a server: files kept and listed by purpose, batch bodies checked by field
(a live batch through the openai client: tests/api/test_server.py)."""

import pytest

from flock.api.batches import BatchService, FileStore
from flock.api.protocol import APIError


def test_files_are_kept_listed_and_deleted(tmp_path):
    files = FileStore(tmp_path / "files")
    f = files.create("in.jsonl", b'{"a": 1}\n', "batch")
    assert files.path(f["id"]).read_bytes() == b'{"a": 1}\n' and files.get(f["id"])["bytes"] == 9
    out = files.create("out.jsonl", b"", "batch_output")
    assert [x["id"] for x in files.listing("batch")["data"]] == [f["id"]] and len(files.listing()["data"]) == 2
    assert [x["id"] for x in files.listing()["data"]] == [out["id"], f["id"]]  # the newest first, as OpenAI's
    page = files.listing(order="asc", limit=1)
    assert [x["id"] for x in page["data"]] == [f["id"]] and page["has_more"] and page["last_id"] == f["id"]
    rest = files.listing(order="asc", after=page["last_id"])
    assert [x["id"] for x in rest["data"]] == [out["id"]] and not rest["has_more"]
    assert files.delete(out["id"])["deleted"] and not files.path(out["id"]).exists()
    for call, param, status in [(lambda: files.get(out["id"]), "file_id", 404),
                                (lambda: files.create("x", b"", "fine-tune"), "purpose", 400)]:
        with pytest.raises(APIError) as e:
            call()
        assert (e.value.param, e.value.status) == (param, status)


def test_bad_batch_bodies_name_the_field(tmp_path):
    files = FileStore(tmp_path)
    service = BatchService(files, app=None)
    batch_input = files.create("in.jsonl", b"", "batch")["id"]
    output = files.create("out.jsonl", b"", "batch_output")["id"]
    good = {"input_file_id": batch_input, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    for body, param, status in [(good | {"input_file_id": "file-none"}, "file_id", 404),
                                (good | {"input_file_id": output}, "input_file_id", 400),
                                (good | {"input_file_id": 3}, "input_file_id", 400),
                                (good | {"endpoint": "/v1/images/generations"}, "endpoint", 400),
                                (good | {"completion_window": "1h"}, "completion_window", 400),
                                (good | {"metadata": "x"}, "metadata", 400)]:
        with pytest.raises(APIError) as e:
            service.create(body)
        assert (e.value.param, e.value.status) == (param, status)
    with pytest.raises(APIError) as e:
        service.get("batch_none")
    assert e.value.status == 404 and service.listing()["data"] == []
