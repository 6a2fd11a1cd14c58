"""The Ray Data processor gives the rows `flock run` gives, with every prefix group inside one batch."""

import json

import pytest

from tests.distributed.conftest import ENGINE

ray = pytest.importorskip("ray")
from flock.distributed.data import FlockEngineProcessorConfig, build_processor  # noqa: E402


def row_of(line: dict) -> dict:
    """A dataset row from a batch line: the id, the prompt (text, chat or token ids) and its sampling."""
    body = line.get("body", line)
    row = {"id": line["custom_id"], "prompt": None, "messages": None, "prompt_token_ids": None}
    for name in ("prompt", "messages", "prompt_token_ids"):
        if name in body:
            row[name] = json.dumps(body[name])
    row["max_tokens"] = body["max_tokens"]
    return row


def preprocess(row: dict) -> dict:
    out = {"id": row["id"], "sampling_params": {"temperature": 0, "max_tokens": row["max_tokens"], "ignore_eos": True}}
    for name in ("prompt", "messages", "prompt_token_ids"):
        if row[name] is not None:
            out[name] = json.loads(row[name])
    return out


def test_processor_rows_equal_flock_run(ray_address, batch):
    inp, reference, _ = batch
    ray.data.DataContext.get_current().enable_progress_bars = False
    lines = [json.loads(line) for line in inp.read_text().splitlines()]
    rows = [row_of(line) for line in lines if line.get("url") != "/v1/embeddings"]  # the processor generates
    reference = {cid: r for cid, r in reference.items() if not cid.startswith("embed-")}
    config = FlockEngineProcessorConfig(model_source=ENGINE["model"], concurrency=2, batch_size=12, num_cpus=0.5,
                                        engine_kwargs={k: v for k, v in ENGINE.items() if k != "model"})
    processor = build_processor(config, preprocess=preprocess, postprocess=lambda row: {
        "id": row["id"], "text": row["generated_text"], "finish_reason": row["finish_reason"],
        "usage": (row["num_input_tokens"], row["num_generated_tokens"]), "tokens": len(row["generated_tokens"]),
        "batch": row["batch_index"]})
    out = processor(ray.data.from_items(rows)).take_all()
    assert len(out) == len(reference)
    got = {r["id"]: (r["text"], r["finish_reason"], *r["usage"]) for r in out}
    assert got == reference
    assert all(r["tokens"] == r["usage"][1] for r in out)
    batches = {}
    for r in out:  # a document's questions, or the chats sharing a system prompt: one batch
        if not r["id"].startswith("ids-"):
            batches.setdefault(r["id"].split("-")[0], set()).add(r["batch"])
    assert all(len(b) == 1 for b in batches.values()) and len({r["batch"] for r in out}) == 4


def test_processor_checks_rows_and_config(ray_address):
    with pytest.raises(ValueError, match="batch_size"):
        build_processor(FlockEngineProcessorConfig(batch_size=0))
    with pytest.raises(TypeError, match="unknown engine argument"):
        build_processor(FlockEngineProcessorConfig(engine_kwargs={"nope": 1}))
    with pytest.raises(ValueError, match="need 3 CPUs, the Ray cluster has 2"):  # it would wait for ever
        build_processor(FlockEngineProcessorConfig(concurrency=2))(ray.data.range(1))
    processor = build_processor(FlockEngineProcessorConfig(), preprocess=lambda row: {
        "prompt": "hi", "sampling_params": {"top_p": 2.0}})
    with pytest.raises(Exception, match="top_p must be in"):
        processor(ray.data.range(1))


def test_processor_defaults_logprobs_and_bad_rows_as_ray_datas_vllm_stage(ray_address):
    """Unset max_tokens is 16 for chats too; logprobs come as vLLM's dicts; no rows, no work; with
    should_continue_on_error a row Flock rejects carries its reason and skips postprocess, the others run."""
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = FlockEngineProcessorConfig(model_source=ENGINE["model"], concurrency=(1, 1), batch_size=4,
                                        engine_kwargs={"max_model_len": 64, "dtype": "float32"},
                                        should_continue_on_error=True)
    rows = [{"id": "chat", "messages": [{"role": "user", "content": "hi"}],
             "sampling_params": {"ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1, "temperature": 0}},
            {"id": "long", "prompt": "word " * 200}, {"id": "bad-id", "prompt_token_ids": [5, 10 ** 7]}]
    processor = build_processor(config, preprocess=lambda row: {k: v for k, v in row.items() if v is not None},
                                postprocess=lambda row: {"id": row["id"], "n": row["num_generated_tokens"],
                                                         "logprobs": row["logprobs"], "prompt": row["prompt_logprobs"]})
    out = {r["id"]: r for r in processor(ray.data.from_items(rows)).take_all()}
    chat = out["chat"]
    assert chat["n"] == 16 and chat["__inference_error__"] == "" and len(chat["logprobs"]) == 16
    first = chat["logprobs"][0]
    assert len(first) >= 2 and all({"logprob", "rank", "decoded_token"} <= set(v) for v in first.values())
    assert chat["prompt"][0] is None and len(chat["prompt"]) > 1
    long = out["long"]  # postprocess skipped: the row as the processor made it
    assert "maximum context length is 64" in long["__inference_error__"] and long.get("n") is None
    assert long["generated_text"] == "" and long["num_generated_tokens"] == 0
    assert "outside the vocabulary" in out["bad-id"]["__inference_error__"]
    assert processor(ray.data.from_items(rows).filter(lambda row: False)).take_all() == []
