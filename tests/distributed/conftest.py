"""One local Ray for the Ray tests (2 CPUs; workers take half a CPU and one torch thread each), the shared
input batch, and its single-engine reference run."""

import json

import pytest

from flock.api.batch import JobConfig, run_job
from flock.config import EngineConfig
from flock.engine.engine import LLMEngine

ENGINE = dict(model="flock/tiny", dtype="float32", attention="torch", scheduler="batchllm",
              kv_cache_memory_bytes=32 << 20)
SYSTEM = "You answer questions about Flock, an engine that computes every shared prefix once. " * 2


def batch_lines() -> list[dict]:
    """5 documents x 8 questions, 6 chats sharing a system prompt, 2 token-id prompts (greedy, 24-66 tokens), the
    documents' embeddings."""
    lines = []
    for d in range(5):
        doc = f"Doc{d} " + " ".join(f"w{d}x{i}" for i in range(50))
        for q in range(8):
            body = {"prompt": f"{doc} Question {q}: why?", "max_tokens": 24 + 6 * q, "ignore_eos": True}
            lines.append({"custom_id": f"doc{d}-q{q}", "method": "POST", "url": "/v1/completions", "body": body})
    for q in range(6):
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {q}?"}],
                "max_tokens": 30, "ignore_eos": True}
        lines.append({"custom_id": f"chat-{q}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    lines += [{"custom_id": f"ids-{k}", "prompt_token_ids": [300 + k] + list(range(500, 540)), "max_tokens": 40,
               "ignore_eos": True} for k in range(2)]
    lines += [{"custom_id": f"embed-{d}", "method": "POST", "url": "/v1/embeddings",
               "body": {"input": f"Doc{d} " + " ".join(f"w{d}x{i}" for i in range(50))}} for d in range(5)]
    return lines


def results(path) -> dict[str, tuple]:
    """custom_id -> (text, finish_reason, prompt tokens, completion tokens), or of an embedding (its length, its
    norm, prompt tokens, 0); each custom_id once."""
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        assert r["custom_id"] not in out, f"two records for {r['custom_id']}"
        body = r["response"]["body"]
        if "data" in body:
            vector = body["data"][0]["embedding"]
            out[r["custom_id"]] = (len(vector), round(sum(v * v for v in vector), 4), body["usage"]["prompt_tokens"], 0)
            continue
        choice = body["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        out[r["custom_id"]] = (text, choice["finish_reason"], body["usage"]["prompt_tokens"],
                               body["usage"]["completion_tokens"])
    return out


def job(inp, out, **kw) -> JobConfig:
    """The batch in `inp`, greedy, into `out`."""
    return JobConfig(str(inp), str(out), **({"quiet": True, "sampling": {"temperature": 0}, "engine": dict(ENGINE)} | kw))


def one_engine_and_cluster(lines: list[dict], engine: dict, tmp_path) -> tuple[dict, dict]:
    """The results of a batch of `lines` through one engine and through 2 Ray workers (see `results`)."""
    from flock.distributed.driver import ClusterConfig, ClusterEngine

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert run_job(job(inp, tmp_path / "one.jsonl"), LLMEngine(EngineConfig.from_kwargs(**engine))) == 0
    cluster = ClusterEngine(engine, ClusterConfig(2, worker_cpus=0.5, worker_threads=1))
    try:
        assert run_job(job(inp, tmp_path / "out.jsonl"), cluster) == 0
    finally:
        cluster.shutdown()
    return results(tmp_path / "one.jsonl"), results(tmp_path / "out.jsonl")


@pytest.fixture(scope="session")
def ray_address():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def batch(tmp_path_factory):
    """The input file, the single engine's results and its computed prefill tokens."""
    folder = tmp_path_factory.mktemp("batch")
    inp = folder / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in batch_lines()))
    engine = LLMEngine(EngineConfig.from_kwargs(**ENGINE))
    assert run_job(job(inp, folder / "single.jsonl"), engine) == 0
    return inp, results(folder / "single.jsonl"), engine.stats.computed_prefill_tokens
