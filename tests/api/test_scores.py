"""vLLM's score and rerank bodies for an embedding model: checked, and answered from the texts' embeddings."""

import pytest

from flock.api.protocol import APIError
from flock.api.scores import parse_scores
from flock.model import resolve_model
from flock.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("flock/tiny").folder)


def test_score_pairs_and_rerank_order(tok):
    s = parse_scores("score", {"text_1": "a query", "text_2": ["doc one", "doc two"]}, tok)
    assert s.prompts == [tok.encode(t, add_special_tokens=True) for t in ("a query", "doc one", "doc two")]
    body = s.body("m", [[1.0, 0.0], [0.6, 0.8], [0.0, 2.0]], 9)
    assert [d["score"] for d in body["data"]] == pytest.approx([0.6, 0.0])
    assert body["object"] == "list" and body["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    pairs = parse_scores("score", {"queries": ["q1", "q2"], "documents": ["d1", "d2"]}, tok)
    assert [d["score"] for d in pairs.body("m", [[1, 0], [0, 1], [1, 0], [1, 1]], 4)["data"]] == \
        pytest.approx([1.0, 2**-0.5])
    r = parse_scores("rerank", {"query": "q", "documents": ["far", {"text": "near"}, "mid"], "top_n": 2}, tok)
    out = r.body("m", [[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [1.0, 1.0]], 8)
    assert [(x["index"], x["document"]["text"]) for x in out["results"]] == [(1, "near"), (2, "mid")]
    assert out["results"][0]["relevance_score"] == pytest.approx(0.995037, abs=1e-6)
    bare = parse_scores("rerank", {"query": "q", "documents": ["a", "b"], "return_documents": False}, tok)
    assert all("document" not in x for x in bare.body("m", [[1, 0], [1, 0], [0, 1]], 3)["results"])
    empty = parse_scores("rerank", {"query": "q", "documents": ["a", "", {"text": ""}]}, tok)  # a RAG batch's chunk
    assert empty.right == ["a", "", ""]


@pytest.mark.parametrize("kind, body, param", [
    ("score", {"text_1": "a"}, "text_1"),
    ("score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("score", {"text_1": "a", "text_2": []}, "text_2"),
    ("score", {"text_1": "a", "text_2": ["ok", 5]}, "text_2"),
    ("rerank", {"query": 3, "documents": ["a"]}, "query"),
    ("rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("rerank", {"query": "q", "documents": ["a"], "n": 2}, "n"),
    ("rerank", {"query": "q", "documents": ["a"], "chat_template_kwargs": {}}, "chat_template_kwargs"),
])
def test_bad_bodies_name_the_field(tok, kind, body, param):
    with pytest.raises(APIError) as e:
        parse_scores(kind, body, tok)
    assert e.value.param == param


def test_vllms_pooling_fields(tok):
    """vLLM 0.32's fields of every pooling body (truncation side, priority, cache salt, ...), scores' token limits
    per query and document, and embeddings' base64 in vLLM's embed_dtype and byte order."""
    import base64

    import numpy as np

    from flock.api.classify import parse_classify
    from flock.api.embeddings import parse_embeddings

    fields = {"truncation_side": "right", "priority": 3, "cache_salt": "s", "request_id": "r", "padding": "do_not_pad",
              "mm_processor_kwargs": {}}
    for req in (parse_embeddings({"input": "x"} | fields, tok), parse_classify({"input": "x"} | fields, tok, ()),
                parse_scores("rerank", {"query": "q", "documents": ["d"]} | fields, tok)):
        run = req.params.as_sampling(64)
        assert (run.truncation_side, run.priority, run.cache_salt) == ("right", 3, "s")
    left = parse_embeddings({"input": "x", "truncation_side": "left", "truncate_prompt_tokens": -1}, tok)
    assert (left.params.as_sampling(64).truncation_side, left.params.as_sampling(64).truncate_prompt_tokens) == \
        ("left", 64)  # -1: all max_model_len tokens (a pooling request generates none)
    with pytest.raises(APIError) as e:
        parse_embeddings({"input": "x", "padding": "max_length"}, tok)
    assert e.value.param == "padding"
    assert parse_embeddings({"input": "x", "use_activation": False}, tok).params.normalize is False

    long = "one two three four five six"
    cut = parse_scores("score", {"text_1": long, "text_2": [long, "a"], "max_tokens_per_query": 2,
                                 "max_tokens_per_doc": 3}, tok)
    first = lambda n: tok.decode(tok.encode(long, add_special_tokens=False)[:n]).strip()  # noqa: E731
    assert cut.left == [first(2)] and cut.right == [first(3), "a"]
    assert cut.prompts[0] == tok.encode(first(2), add_special_tokens=True)

    req = parse_embeddings({"input": "x", "encoding_format": "base64", "embed_dtype": "float16",
                            "endianness": "big"}, tok)
    encoded = req.body("m", [[0.5, -1.25]], 1)["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(encoded), ">f2").tolist() == [0.5, -1.25]
    with pytest.raises(APIError) as e:
        parse_embeddings({"input": "x", "embed_dtype": "int8"}, tok)
    assert e.value.param == "embed_dtype"
