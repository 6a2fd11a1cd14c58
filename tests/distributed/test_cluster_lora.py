"""`flock run --workers N --lora-modules ...`: the workers load the adapters and answer as one engine does."""

import json

import pytest

from flock.api.batch import run_job
from flock.engine.engine import LLMEngine
from flock.config import EngineConfig
from tests.distributed.conftest import job, results
from tests.lora.adapters import ALL_LLAMA, make_adapter

ray = pytest.importorskip("ray")
from flock.distributed.driver import ClusterConfig, ClusterEngine  # noqa: E402


def test_workers_run_a_lines_adapter(ray_address, hf_folders, tmp_path):
    base = hf_folders["llama"]
    adapter = make_adapter(base, tmp_path / "sql", 5, ALL_LLAMA)
    engine = dict(model=str(base), dtype="float32", scheduler="batchllm", lora_modules=[f"sql={adapter}"])
    doc = "a shared document " * 8
    lines = [{"custom_id": f"q{i}-{model}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"{doc} question {i}", "max_tokens": 6, "ignore_eos": True,
                       "temperature": 0}}
             for i in range(4) for model in ("sql", "base")]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert run_job(job(inp, tmp_path / "one.jsonl"), LLMEngine(EngineConfig.from_kwargs(**engine))) == 0
    cluster = ClusterEngine(engine, ClusterConfig(2, worker_cpus=0.5, worker_threads=1))
    try:
        assert run_job(job(inp, tmp_path / "out.jsonl"), cluster) == 0
    finally:
        cluster.shutdown()
    one = results(tmp_path / "one.jsonl")
    assert results(tmp_path / "out.jsonl") == one
    assert all(one[f"q{i}-sql"] != one[f"q{i}-base"] for i in range(4))
