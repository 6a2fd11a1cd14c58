"""Sequence classifiers (LLM.classify, cross-encoder LLM.score): the class probabilities of the last prompt
token's final hidden state equal transformers' *ForSequenceClassification on the same weights under every
scheduler, chunk size and prefix-cache state; a causal LM reranker (hf_overrides classifier_from_token) scores as
its two tokens' softmax; everything else the model does not serve is refused by name."""

import pytest
import torch

from flock import LLM, PoolingParams, SamplingParams
from tests.engine.classifiers import LABELS, RERANK_TOKENS, RERANKER, reference_logits, save
from tests.engine.test_parity import assert_no_leak, shared_prefix_prompts

QUERY = "where do the blocks of the cache come from"
DOCS = ["the pool hands out blocks", "a scheduler plans steps", "rain in paris", "blocks come from the pool"]


@pytest.fixture(scope="module")
def qwen3_labels(tmp_path_factory):
    return save(tmp_path_factory.mktemp("qwen3-cls"), "qwen3", num_labels=3, id2label=LABELS,
                label2id={v: k for k, v in LABELS.items()})


@pytest.fixture(scope="module")
def llama_cross_encoder(tmp_path_factory):
    return save(tmp_path_factory.mktemp("llama-ce"), "llama", seed=1, num_labels=1)


@pytest.fixture(scope="module")
def qwen3_causal(tmp_path_factory):
    return save(tmp_path_factory.mktemp("qwen3-lm"), "qwen3", seed=2, causal=True)


def classify(llm: LLM, prompts, params: PoolingParams | None = None) -> torch.Tensor:
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return torch.tensor([o.outputs.probs for o in outs], dtype=torch.float64)


@pytest.mark.parametrize("scheduler, chunk", [("fcfs", 4096), ("fcfs", 7), ("batchllm", 24), ("feather", 16),
                                              ("lpm", 9)])
def test_probabilities_equal_transformers(qwen3_labels, scheduler, chunk):
    prompts = shared_prefix_prompts(seed=6)
    expected = reference_logits(qwen3_labels, prompts).softmax(-1)
    llm = LLM(str(qwen3_labels), dtype="float64", scheduler=scheduler, max_num_batched_tokens=chunk, block_size=4)
    torch.testing.assert_close(classify(llm, prompts), expected, rtol=0, atol=1e-10)
    assert llm.stats()["saving_rate"] > 0.2  # the shared prefixes' KV computed once
    again = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)  # from the prefix cache
    assert sum(o.num_cached_tokens for o in again) > 0
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in again], dtype=torch.float64), expected,
                               rtol=0, atol=1e-10)
    assert_no_leak(llm)


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_logits_without_activation_and_other_dtypes(qwen3_labels, dtype, atol):
    prompts = shared_prefix_prompts(seed=7)[:4]
    expected = reference_logits(qwen3_labels, prompts)
    llm = LLM(str(qwen3_labels), dtype=dtype)
    torch.testing.assert_close(classify(llm, prompts, PoolingParams(use_activation=False)), expected, rtol=0,
                               atol=atol * 4)
    torch.testing.assert_close(classify(llm, prompts), expected.softmax(-1), rtol=0, atol=atol)


def test_cross_encoder_scores_pairs_as_transformers(llama_cross_encoder):
    """One label: LLM.score is the sigmoid of the pair's logit, the pair encoded as the tokenizer encodes pairs."""
    llm = LLM(str(llama_cross_encoder), dtype="float64")
    tok = llm.get_tokenizer()
    pairs = [tok(QUERY, text_pair=d)["input_ids"] for d in DOCS]
    expected = reference_logits(llama_cross_encoder, pairs)[:, 0].sigmoid().tolist()
    scores = llm.score(QUERY, DOCS, use_tqdm=False)
    assert [s.outputs.score for s in scores] == pytest.approx(expected, abs=1e-12)
    assert [s.prompt_token_ids for s in scores] == pairs
    in_order = llm.score([QUERY, "rain"], DOCS[:2], use_tqdm=False)
    assert in_order[0].outputs.score == pytest.approx(expected[0], abs=1e-12)
    assert [c.outputs.probs[0] for c in llm.classify([{"prompt_token_ids": p} for p in pairs], use_tqdm=False)] \
        == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm"])
def test_causal_lm_reranker_scores_its_two_tokens(qwen3_causal, scheduler):
    """Qwen3-Reranker's recipe: the softmax probability of the second token against the first at the last
    position of query + document (joined, no separator), computed once per query's shared prefix."""
    check_reranker(qwen3_causal, RERANKER, scheduler)


def test_an_untied_reranker_frees_its_head(tmp_path):
    folder = save(tmp_path / "llama-lm", "llama", seed=3, causal=True)
    llm = check_reranker(folder, RERANKER | {"architectures": ["LlamaForSequenceClassification"],
                                             "method": "from_2_way_softmax"}, "fcfs")
    assert llm.engine.runner.model.lm_head is None


def check_reranker(folder, overrides: dict, scheduler: str) -> LLM:
    llm = LLM(str(folder), dtype="float64", hf_overrides=overrides, scheduler=scheduler, block_size=4,
              runner="pooling")  # vLLM's keyword, accepted
    tok = llm.get_tokenizer()
    prompts = [tok(QUERY + d)["input_ids"] for d in DOCS]
    ids = tok.convert_tokens_to_ids(RERANK_TOKENS)
    expected = reference_logits(folder, prompts)[:, ids].softmax(-1)[:, 1].tolist()
    scores = llm.score(QUERY, DOCS, use_tqdm=False)
    assert [s.outputs.score for s in scores] == pytest.approx(expected, abs=1e-12)
    assert [s.prompt_token_ids for s in scores] == prompts
    assert llm.stats()["saving_rate"] > 0.2
    rows = LLM(str(folder), dtype="float64", hf_overrides=overrides | {"method": "no_post_processing",
                                                                        "is_original_qwen3_reranker": False})
    got = rows.classify([{"prompt_token_ids": p} for p in prompts], PoolingParams(use_activation=False),
                        use_tqdm=False)
    torch.testing.assert_close(torch.tensor([g.outputs.probs for g in got], dtype=torch.float64),
                               reference_logits(folder, prompts)[:, ids], rtol=0, atol=1e-12)
    return llm


def test_score_template_lays_out_qwen3_rerankers_prompt(qwen3_causal):
    """--chat-template on a cross-encoder (vLLM's score template): each pair through the template as a "query"
    and a "document" turn; examples/qwen3_reranker.jinja gives Qwen3-Reranker's published prompt."""
    from pathlib import Path

    from flock.api.protocol import APIError
    from flock.api.scores import parse_scores

    template = Path(__file__).parents[2] / "examples" / "qwen3_reranker.jinja"
    llm = LLM(str(qwen3_causal), dtype="float64", hf_overrides=RERANKER, chat_template=str(template))
    tok = llm.get_tokenizer()
    head = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
            'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: {}\n'
            '<Query>: {}\n')
    tail = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    default = "Given a web search query, retrieve relevant passages that answer the query"
    prompts = [tok(head.format(default, QUERY) + f"<Document>: {d}" + tail)["input_ids"] for d in DOCS]
    ids = tok.convert_tokens_to_ids(RERANK_TOKENS)
    expected = reference_logits(qwen3_causal, prompts)[:, ids].softmax(-1)[:, 1].tolist()
    scores = llm.score(QUERY, DOCS, use_tqdm=False)
    assert [s.prompt_token_ids for s in scores] == prompts
    assert [s.outputs.score for s in scores] == pytest.approx(expected, abs=1e-12)
    body = {"query": QUERY, "documents": DOCS[:1], "chat_template_kwargs": {"instruction": "Find the pool"}}
    rerank = parse_scores("rerank", body, tok, llm.engine.tasks)
    assert rerank.prompts == [tok(head.format("Find the pool", QUERY) + f"<Document>: {DOCS[0]}" + tail)["input_ids"]]
    strict = LLM(str(qwen3_causal), hf_overrides=RERANKER, load_format="dummy",
                 chat_template="{{ raise_exception('no instruction') if instruction is undefined }}")
    with pytest.raises(APIError, match="the score template failed on this pair: no instruction") as e:
        parse_scores("score", {"text_1": "q", "text_2": "d"}, tok, strict.engine.tasks)
    assert e.value.param == "chat_template_kwargs"


def test_a_quantized_gguf_reranker_takes_its_rows_from_the_blocks(qwen3_causal, tmp_path):
    """A llama.cpp Qwen3-Reranker file (a causal LM, its head in Q8_0 blocks) with the same overrides: the score
    row is the dequantized head's, and the scores follow the float run of the same file."""
    from gguf import GGMLQuantizationType as Q

    from tests.model.gguf_files import write_gguf

    path = write_gguf(qwen3_causal, tmp_path / "reranker.gguf", Q.Q8_0)
    kept, floats = (LLM(str(path), hf_overrides=RERANKER, quantization=q, dtype="float32") for q in ("auto", "none"))
    assert kept.engine.runner.model.lm_head.qweight is not None
    torch.testing.assert_close(kept.engine.runner.model.score.weight, floats.engine.runner.model.score.weight,
                               rtol=0, atol=0)
    got, want = ([s.outputs.score for s in llm.score(QUERY, DOCS, use_tqdm=False)] for llm in (kept, floats))
    assert got == pytest.approx(want, abs=2e-2)


def test_what_a_model_does_not_serve_is_refused_by_name(qwen3_labels, qwen3_causal):
    classifier = LLM(str(qwen3_labels), dtype="float32")
    with pytest.raises(ValueError, match="is a sequence classifier: it classifies .* it does not generate"):
        classifier.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="it does not embed"):
        classifier.embed([[1, 2, 3]], use_tqdm=False)
    with pytest.raises(ValueError, match="classifies into 3 classes: scores need a classifier of one label"):
        classifier.score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions is an embedding's"):
        classifier.classify([[1, 2]], PoolingParams(dimensions=4), use_tqdm=False)
    generator = LLM(str(qwen3_causal), dtype="float32")
    with pytest.raises(ValueError, match="is not a sequence classifier"):
        generator.classify("text", use_tqdm=False)
    with pytest.raises(ValueError, match="classifier_from_token 'yes' is not a token of the vocabulary"):
        LLM(str(qwen3_causal), hf_overrides=RERANKER | {"classifier_from_token": ["no", "yes"]})
    with pytest.raises(ValueError, match="from_2_way_softmax takes two classifier_from_token"):
        LLM(str(qwen3_causal), hf_overrides=RERANKER | {"classifier_from_token": ["no", "part", "ever"]})
    with pytest.raises(ValueError, match="classifier_from_token needs method"):
        LLM(str(qwen3_causal), hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                             "classifier_from_token": RERANK_TOKENS})


@pytest.mark.parametrize("extra, labels, activation", [
    ({"id2label": {"0": "neg", "1": "pos"}}, ("neg", "pos"), "softmax"),
    ({"num_labels": 1}, ("LABEL_0",), "sigmoid"),
    ({"id2label": {"0": "a", "1": "b"}, "problem_type": "multi_label_classification"}, ("a", "b"), "sigmoid"),
    ({"num_labels": 1, "problem_type": "regression"}, ("LABEL_0",), "identity"),
    ({"num_labels": 1, "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}},
     ("LABEL_0",), "identity"),
    ({"num_labels": 3, "sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"},
     ("LABEL_0", "LABEL_1", "LABEL_2"), "sigmoid"),
    ({}, ("LABEL_0", "LABEL_1"), "softmax"),  # transformers' default: two labels
])
def test_labels_and_activation_as_vllm_reads_them(extra, labels, activation):
    from flock.model.config import ModelConfig
    from tests.conftest import HF_CONFIGS, VOCAB

    c = ModelConfig.from_dict(HF_CONFIGS["llama"] | {"vocab_size": VOCAB,
                                                    "architectures": ["LlamaForSequenceClassification"]} | extra)
    assert (c.labels, c.classifier_activation, c.tie_word_embeddings) == (labels, activation, True)
    with pytest.raises(ValueError, match="activation 'torch.nn.modules.activation.Tanh' is not supported"):
        ModelConfig.from_dict(HF_CONFIGS["llama"] | {"vocab_size": VOCAB, "architectures": [
            "LlamaForSequenceClassification"], "sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"})
