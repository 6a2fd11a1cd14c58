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
    processor = build_processor(FlockEngineProcessorConfig(), preprocess=lambda row: {
        "prompt": "hi", "sampling_params": {"top_p": 2.0}})
    with pytest.raises(Exception, match="top_p must be in"):
        processor(ray.data.range(1))
