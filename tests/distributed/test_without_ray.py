"""Without Ray installed, `flock run --workers` says how to get it (and the one-engine path needs no Ray)."""

import json
import sys

from flock import cli


def test_workers_without_ray_say_how_to_install_it(tmp_path, monkeypatch, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n")
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    monkeypatch.delitem(sys.modules, "flock.distributed.driver", raising=False)
    assert cli.main(["run", str(inp), "-o", str(tmp_path / "out.jsonl"), "--workers", "2"]) == 2
    assert "pip install 'flock-llm[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
