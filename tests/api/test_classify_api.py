"""vLLM's /classify (and SGLang's /v1/classify), and /score and /rerank on a cross-encoder, in `flock serve` and
in batch jobs: the offline LLM.classify's probabilities and LLM.score's scores; what the model does not serve is
a 400 naming why."""

import json
import math

import httpx
import pytest

from bench.harness.server_process import ServerProcess
from flock import LLM
from flock.api.batch import JobConfig, run_job
from flock.api.classify import parse_classify
from flock.api.protocol import APIError
from flock.config import EngineConfig
from flock.engine.engine import LLMEngine
from tests.engine.classifiers import LABELS, RERANKER, save

QUERY = "where do the blocks of the cache come from"
DOCS = ["the pool hands out blocks", "a scheduler plans steps", "rain in paris"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return save(tmp_path_factory.mktemp("qwen3-lm"), "qwen3", seed=2, causal=True)


@pytest.fixture(scope="module")
def server(reranker):
    with ServerProcess("--model", str(reranker), "--served-model-name", "rr", "--dtype", "float32",
                       "--hf-overrides", json.dumps(RERANKER), "--runner", "pooling", env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


def test_server_classifies_and_cross_encodes_as_the_offline_llm(server, reranker):
    offline = LLM(str(reranker), dtype="float32", hf_overrides=RERANKER)
    scores = [s.outputs.score for s in offline.score(QUERY, DOCS, use_tqdm=False)]
    post = lambda path, body: httpx.post(f"{server.url}{path}", json=body, timeout=30)  # noqa: E731
    for path in ("/classify", "/v1/classify"):
        body = post(path, {"model": "rr", "input": [QUERY + d for d in DOCS]}).json()
        assert [d["probs"][0] for d in body["data"]] == pytest.approx(scores, abs=1e-5)
        assert {(d["label"], d["num_classes"]) for d in body["data"]} == {("LABEL_0", 1)}
        assert body["object"] == "list" and body["usage"]["completion_tokens"] == 0
    body = post("/v1/score", {"model": "rr", "text_1": QUERY, "text_2": DOCS}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(scores, abs=1e-5)
    body = post("/rerank", {"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [(r["index"], r["relevance_score"]) for r in body["results"]] == \
        [(i, pytest.approx(scores[i], abs=1e-5)) for i in order]
    pooled = post("/pooling", {"model": "rr", "input": [QUERY + d for d in DOCS]}).json()  # vLLM's: classify here
    assert [d["data"][0] for d in pooled["data"]] == pytest.approx(scores, abs=1e-5)
    assert {d["object"] for d in pooled["data"]} == {"pooling"} and pooled["id"].startswith("pool-")
    assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 200  # the model pools its token
    raw = post("/classify", {"input": QUERY + DOCS[0], "use_activation": False}).json()["data"][0]["probs"]
    assert raw[0] == pytest.approx(math.log(scores[0] / (1 - scores[0])), abs=1e-4)  # the logit
    for path, body, param, why in [
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, None, "it does not generate"),
            ("/v1/embeddings", {"input": "hi"}, "input", "it does not embed"),
            ("/classify", {"input": "hi", "n": 2}, "n", "not supported here"),
            ("/classify", {"input": ""}, "input", "empty"),
            ("/classify", {"input": "hi", "use_activation": "no"}, "use_activation", "must be a bool"),
            ("/pooling", {"input": "hi", "task": "encode"}, "task", "not supported"),
            ("/pooling", {"input": "hi", "task": "token_classify"}, None, "not a token classifier"),
            ("/pooling", {"input": "hi", "task": "embed"}, "input", "it does not embed")]:
        bad = post(path, {"model": "rr"} | body)
        assert bad.status_code == 400 and why in bad.json()["error"]["message"], (path, bad.json())
        assert param is None or bad.json()["error"]["param"] == param


def test_labels_name_the_most_likely_class():
    req = parse_classify({"input": [[1, 2], [3]]}, None, tuple(LABELS.values()))
    body = req.body("m", [[0.1, 0.2, 0.7], [0.5, 0.3, 0.2]], 3)
    assert [(d["index"], d["label"], d["num_classes"]) for d in body["data"]] == [(0, "positive", 3), (1, "negative", 3)]
    assert req.params.task == "classify" and body["usage"]["prompt_tokens"] == 3
    with pytest.raises(APIError) as e:
        parse_classify({"input": "x", "temperature": 0.5}, None, ())
    assert e.value.param == "temperature"


def test_batch_lines_classify_and_score_pairs(tmp_path):
    folder = save(tmp_path / "ce", "llama", seed=1, num_labels=3, id2label=LABELS,
                  label2id={v: k for k, v in LABELS.items()})
    line = lambda cid, url, body: json.dumps({"custom_id": cid, "method": "POST", "url": url,  # noqa: E731
                                              "body": body})
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([line("c", "/v1/classify", {"input": DOCS}),
                              line("s", "/v1/score", {"text_1": QUERY, "text_2": DOCS})]) + "\n")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(folder), dtype="float32"))
    assert run_job(JobConfig(str(inp), str(tmp_path / "out.jsonl"), quiet=True), engine) == 0
    (ok,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    expected = LLM(str(folder), dtype="float32").classify(DOCS, use_tqdm=False)
    assert [d["probs"] for d in ok["response"]["body"]["data"]] == \
        [pytest.approx(e.outputs.probs, abs=1e-6) for e in expected]
    (error,) = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert error["custom_id"] == "s" and "classifies into 3 classes" in error["error"]["message"]
