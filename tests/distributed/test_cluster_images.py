"""`flock run --workers N` on a vision-language model: batch lines with images answer as one engine does."""

import json

import pytest

from flock.api.batch import run_job
from flock.config import EngineConfig
from flock.engine.engine import LLMEngine
from tests.distributed.conftest import job, results
from tests.multimodal.models import picture
from tests.multimodal.test_images_api import body, data_url

ray = pytest.importorskip("ray")
from flock.distributed.driver import ClusterConfig, ClusterEngine  # noqa: E402


def test_workers_answer_lines_with_images(ray_address, llava_folder, tmp_path):
    engine = dict(model=str(llava_folder), dtype="float32", scheduler="batchllm")
    lines = [{"custom_id": f"i{i}-q{q}", "method": "POST", "url": "/v1/chat/completions",
              "body": body(data_url(picture(i)), f"question {q}")}
             for i in range(3) for q in range(2)]
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
    assert len({one[f"i{i}-q0"] for i in range(3)}) == 3  # the images, not only the text, decide the answers
