"""Output files: torn tails cut away on resume, corrupt files refused, records appended durably."""

import json
import logging

import pytest

from flock.api.batch_output import CorruptFileError, JsonlAppender, error_record, load_records, result_record


def write(path, records, tail=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail)


def test_appender_writes_whole_lines_and_creates_lazily(tmp_path):
    path = tmp_path / "out.jsonl"
    w = JsonlAppender(path, sync_every=2)
    assert not path.exists()
    for i in range(3):
        w.write(result_record(f"c{i}", f"cmpl-{i}", {"x": "é"}))
    assert w.unsynced == 1  # synced after the second record
    w.close()
    got = load_records(path)
    assert [r["custom_id"] for r in got] == ["c0", "c1", "c2"] and got[0]["response"]["body"] == {"x": "é"}
    assert got[0]["error"] is None and got[0]["id"].startswith("batch_req_")
    e = error_record(None, 7, "bad", "invalid_json")
    assert e == {"id": e["id"], "custom_id": None, "response": None,
                 "error": {"code": "invalid_json", "message": "line 7: bad", "param": None, "line": 7}}


@pytest.mark.parametrize("tail", [b'{"id": "batch_req_x", "custom_id": "c', b"\x00\x00\x00\x00", b"\x00\x00\n\x00",
                                  b'{"custom_id": "c9"\n', b"[1, 2]\n"],
                         ids=["torn", "zeros", "zeros-newline", "torn-newline", "not-a-record"])
def test_torn_tail_is_truncated_with_a_warning(tmp_path, caplog, tail):
    path = tmp_path / "out.jsonl"
    good = [{"custom_id": "c0"}, {"custom_id": "c1"}]
    write(path, good, tail)
    with caplog.at_level(logging.WARNING, logger="flock"):
        assert load_records(path) == good
    assert "incomplete record" in caplog.text
    assert path.read_bytes() == b"".join(json.dumps(r).encode() + b"\n" for r in good)
    caplog.clear()
    assert load_records(path) == good and caplog.text == ""


def test_bad_line_before_good_ones_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"custom_id": "a"}\nnot a record\n{"custom_id": "b"}\n')
    with pytest.raises(CorruptFileError, match="line 2"):
        load_records(path)
    assert b'"b"' in path.read_bytes()  # left untouched
