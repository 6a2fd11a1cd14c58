"""`flock run --workers N --lora-modules ...`: the workers load the adapters and answer as one engine does."""

import pytest

from tests.distributed.conftest import one_engine_and_cluster
from tests.lora.adapters import ALL_LLAMA, make_adapter

ray = pytest.importorskip("ray")


def test_workers_run_a_lines_adapter(ray_address, hf_folders, tmp_path):
    base = hf_folders["llama"]
    adapter = make_adapter(base, tmp_path / "sql", 5, ALL_LLAMA)
    engine = dict(model=str(base), dtype="float32", scheduler="batchllm", lora_modules=[f"sql={adapter}"])
    doc = "a shared document " * 8
    lines = [{"custom_id": f"q{i}-{model}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"{doc} question {i}", "max_tokens": 6, "ignore_eos": True,
                       "temperature": 0}}
             for i in range(4) for model in ("sql", "base")]
    one, cluster = one_engine_and_cluster(lines, engine, tmp_path)
    assert cluster == one
    assert all(one[f"q{i}-sql"] != one[f"q{i}-base"] for i in range(4))
