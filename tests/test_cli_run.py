"""`flock run` argument handling that stops before any engine is built (exit status 2)."""

import json

import pytest

from flock import cli


@pytest.fixture
def batch(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    return path


def run(capsys, *argv) -> tuple[int, str]:
    try:
        code = cli.main(["run", *map(str, argv)])
    except SystemExit as e:  # argparse
        code = e.code
    return code, capsys.readouterr().err


def test_existing_output_or_error_file_needs_a_flag(tmp_path, batch, capsys):
    out = tmp_path / "res.jsonl"
    out.write_text('{"custom_id": "line-1"}\n')
    code, err = run(capsys, batch, "-o", out)
    assert code == 2 and f"{out} already exists" in err and "--resume" in err and "--overwrite" in err
    out.unlink()
    errors = tmp_path / "res.errors.jsonl"
    errors.write_text("")
    code, err = run(capsys, batch, "-o", out)
    assert code == 2 and f"{errors} already exists" in err


def test_bad_invocations(tmp_path, batch, capsys):
    out = tmp_path / "o.jsonl"
    assert run(capsys, batch, "-o", out, "--resume", "--overwrite")[0] == 2
    code, err = run(capsys, tmp_path / "missing.jsonl", "-o", out)
    assert code == 2 and "cannot read" in err
    code, err = run(capsys, batch, "-o", batch)
    assert code == 2 and "different files" in err
    code, err = run(capsys, batch, "-o", out, "--max-tokens", "0")
    assert code == 2 and "--max-tokens" in err
    code, err = run(capsys, batch, "-o", out, "--top-p", "2")
    assert code == 2 and "--top-p" in err
    assert not out.exists()
