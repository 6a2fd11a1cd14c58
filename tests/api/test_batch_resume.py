"""`flock run` killed (SIGKILL) at several points and resumed ends with exactly the results of an uninterrupted run."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from flock.cli import main
from flock.model.builtin import _llama, write_tokenizer

DOC = "Flock computes a shared prefix once; blocks are paged, reference counted and named by chained hashes. "
ENGINE = ["--load-format", "dummy", "--dtype", "float64", "--attention", "torch", "--temperature", "0", "-q"]


def small_model(folder: Path) -> Path:
    """A 2-layer Llama config with the built-in tokenizer: random weights, fast to build and to run."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_llama(64, 2, 4, 2, 128, 8192, max_len=512)))
    write_tokenizer(folder, 8192)
    return folder


def write_input(path: Path, n: int = 24) -> list[str]:
    lines = []
    for i in range(n):
        cid = f"req-{i}"
        if i % 3 == 2:
            body = {"messages": [{"role": "system", "content": DOC}, {"role": "user", "content": f"question {i}?"}]}
            url = "/v1/chat/completions"
        else:
            body = {"prompt": f"{DOC}Question {i}: why?"}
            url = "/v1/completions"
        body |= {"max_tokens": 4 + i * 5 % 29, "ignore_eos": True}  # finishing over ~30 steps
        lines.append({"custom_id": cid, "method": "POST", "url": url, "body": body})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return [x["custom_id"] for x in lines]


def comparable(path: Path) -> dict[str, dict]:
    """custom_id -> response body without the fields that differ between runs (ids, time, cache hits)."""
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        assert r["custom_id"] not in out, f"duplicate result for {r['custom_id']}"
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        u = body["usage"]
        out[r["custom_id"]] = {"object": body["object"], "model": body["model"], "choices": body["choices"],
                               "usage": (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])}
    return out


def result_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def run_until(args: list[str], stop, timeout: float = 120.0) -> subprocess.CompletedProcess | None:
    """Start `flock run`; SIGKILL it as soon as `stop()` holds. The finished process if it ended first."""
    proc = subprocess.Popen([sys.executable, "-m", "flock.cli", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if stop():
            proc.kill()
            proc.communicate()
            return None
        time.sleep(0.01)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_killed_and_resumed_equals_uninterrupted(tmp_path):
    inp, out, ref = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    ids = write_input(inp)
    args = [str(inp), "-o", str(out), "--model", str(small_model(tmp_path / "model")), *ENGINE]

    # killed while importing / loading: nothing written yet
    started = time.monotonic()
    assert run_until(args, lambda: time.monotonic() - started > 0.3) is None
    # killed after the first results; then a power loss tears the last line
    assert run_until([*args, "--resume"], lambda: result_lines(out) >= 1) is None
    first = result_lines(out)
    assert 1 <= first < len(ids)
    with open(out, "ab") as f:
        f.write(b'{"id": "batch_req_torn", "custom_id": "req-')
    # killed in the middle of the job
    assert run_until([*args, "--resume"], lambda: result_lines(out) >= first + 6) is None
    middle = result_lines(out)
    assert first + 6 <= middle < len(ids), "the kill should land before the job ends"
    assert out.read_bytes().endswith(b"\n") and b"batch_req_torn" not in out.read_bytes()
    # the last resume finishes the job
    done = run_until([*args, "--resume"], lambda: False)
    assert done.returncode == 0, done.stderr
    assert f"{len(ids) - middle} succeeded, 0 failed, {middle} skipped" in done.stdout

    assert main(["run", str(inp), "-o", str(ref), *args[3:]]) == 0
    resumed, uninterrupted = comparable(out), comparable(ref)
    assert sorted(resumed) == sorted(ids)
    assert resumed == uninterrupted
    assert not (tmp_path / "out.errors.jsonl").exists()
