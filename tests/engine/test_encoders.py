"""Bidirectional encoders (BERT, XLM-RoBERTa, ModernBERT): embeddings and class probabilities equal transformers'
on the same weights whatever the scheduler and token budget (each prompt computed whole, none read from a prefix cache);
pairs carry BERT's token types; sentence-transformers' pooling is read from the folder; what an encoder cannot do
is refused by name."""

import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from flock import LLM, LoRARequest, PoolingParams, SamplingParams
from flock.model import save_model
from tests.engine.encoders import WORDS, reference, save_encoder, save_modernbert


def sentences(seed: int, count: int = 9) -> list[str]:
    """Texts of 1 to 40 words, the later ones repeating an earlier one's first words (a prefix cache would
    wrongly serve them)."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 40))) for _ in range(count)]
    return texts + [t.rsplit(" ", 1)[0] + " water" for t in texts[:3] if " " in t]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return save_encoder(tmp_path_factory.mktemp("bert"), "bert")


@pytest.fixture(scope="module")
def xlmr_classifier(tmp_path_factory):
    return save_encoder(tmp_path_factory.mktemp("xlmr-cls"), "xlm-roberta", num_labels=3, seed=1)


@pytest.fixture(scope="module")
def bert_cross_encoder(tmp_path_factory):
    return save_encoder(tmp_path_factory.mktemp("bert-ce"), "bert", num_labels=1, seed=2)


def embeddings(llm: LLM, texts, params: PoolingParams | None = None) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(texts, params, use_tqdm=False)], dtype=torch.float64)


@pytest.mark.parametrize("scheduler, budget", [("fcfs", 2048), ("fcfs", 8), ("batchllm", 16), ("priority", 30)])
def test_bert_embeddings_equal_transformers(bert, scheduler, budget):
    texts = sentences(0)
    expected = F.normalize(torch.stack([h[0] for h in reference(bert, texts)]), dim=1)  # the [CLS] row
    llm = LLM(str(bert), dtype="float64", scheduler=scheduler, max_num_batched_tokens=budget, max_num_seqs=4,
              hf_overrides={"is_matryoshka": True})
    torch.testing.assert_close(embeddings(llm, texts), expected, rtol=0, atol=1e-12)
    assert llm.stats()["saving_rate"] == 0  # nothing is read from a prefix cache
    raw = embeddings(llm, texts[:2], PoolingParams(normalize=False, dimensions=5))
    torch.testing.assert_close(raw, torch.stack([h[0, :5] for h in reference(bert, texts[:2])]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("attention", ["cpu", "torch", "torch-cascade"])
def test_every_attention_backend_attends_both_ways(bert, attention):
    from flock.attention import cpu

    if attention == "cpu" and cpu.kernel_unavailable():
        pytest.skip(f"the CPU attention kernel: {cpu.kernel_unavailable()}")
    texts = sentences(5)
    expected = F.normalize(torch.stack([h[0] for h in reference(bert, texts)]), dim=1)
    llm = LLM(str(bert), dtype="float32", attention=attention, max_num_batched_tokens=64, block_size=4)
    assert llm.engine.runner.paths["attention"].startswith(attention)
    torch.testing.assert_close(embeddings(llm, texts), expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype, attention, atol", [("float64", "auto", 1e-12), ("float32", "cpu", 2e-6),
                                                     ("float32", "torch", 2e-6)])
def test_modernbert_embeddings_equal_transformers(tmp_path, dtype, attention, atol):
    """Its local layers see 4 positions on either side, its global ones the whole prompt, each with its own
    rotary base."""
    from flock.attention import cpu

    if attention == "cpu" and cpu.kernel_unavailable():
        pytest.skip(f"the CPU attention kernel: {cpu.kernel_unavailable()}")
    folder = save_modernbert(tmp_path / "modernbert")
    texts = sentences(6)
    expected = F.normalize(torch.stack([h[0] for h in reference(folder, texts)]), dim=1)
    ops = "torch" if attention == "torch" else "auto"  # the reference rotary embedding, or the fused kernel's
    llm = LLM(str(folder), dtype=dtype, attention=attention, ops=ops, max_num_batched_tokens=32)
    torch.testing.assert_close(embeddings(llm, texts), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_classifier_equals_transformers(tmp_path, pooling):
    folder = save_modernbert(tmp_path / "modernbert-cls", num_labels=2, seed=4, classifier_pooling=pooling,
                             classifier_bias=True)
    texts = sentences(7)
    expected = torch.stack(reference(folder, texts)).softmax(-1)
    probs = LLM(str(folder), dtype="float64").classify(texts, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in probs], dtype=torch.float64), expected,
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode, pool", [("pooling_mode_mean_tokens", lambda h: h.mean(0)),
                                        ("pooling_mode_lasttoken", lambda h: h[-1]),
                                        ("pooling_mode_cls_token", lambda h: h[0])])
def test_sentence_transformers_pooling(tmp_path, mode, pool):
    folder = save_encoder(tmp_path / "st", "xlm-roberta", seed=3, pooling=mode)
    texts = sentences(1, count=4)
    expected = F.normalize(torch.stack([pool(h) for h in reference(folder, texts)]), dim=1)
    torch.testing.assert_close(embeddings(LLM(str(folder), dtype="float64"), texts), expected, rtol=0, atol=1e-12)


def test_checkpoints_named_as_tensorflow_named_them_load(tmp_path, bert):
    """Older BERT checkpoints call a LayerNorm's weight and bias gamma and beta, under a bert. prefix."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "tf-names"
    shutil.copytree(bert, folder)
    tensors = load_file(folder / "model.safetensors")
    renamed = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in tensors.items()}
    assert any(k.endswith("gamma") for k in renamed)
    save_file(renamed, folder / "model.safetensors")
    texts = sentences(10, count=3)
    torch.testing.assert_close(embeddings(LLM(str(folder), dtype="float64"), texts),
                               embeddings(LLM(str(bert), dtype="float64"), texts), rtol=0, atol=0)


def test_sentence_transformers_max_seq_length_is_the_default_limit(tmp_path):
    folder = save_encoder(tmp_path / "st", "bert", pooling="pooling_mode_mean_tokens")
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 16, "do_lower_case": false}')
    assert LLM(str(folder)).engine.max_model_len == 16
    assert LLM(str(folder), max_model_len=12).engine.max_model_len == 12
    with pytest.raises(ValueError, match="max_model_len=64 is longer than the model's 16 positions"):
        LLM(str(folder), max_model_len=64)  # as vLLM's, unless FLOCK_ALLOW_LONG_MAX_MODEL_LEN is set


def test_a_folder_without_a_normalize_module_embeds_unnormalized(tmp_path):
    """sentence-transformers (and vLLM) normalize only where modules.json lists Normalize (the dot-product
    models list none); a request's normalize / use_activation still decides."""
    folder = save_encoder(tmp_path / "dot", "bert", pooling="pooling_mode_mean_tokens")
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps([m for m in modules if not m["type"].endswith("Normalize")]))
    texts = sentences(4, count=3)
    mean = torch.stack([h.mean(0) for h in reference(folder, texts)])
    llm = LLM(str(folder), dtype="float64")
    torch.testing.assert_close(embeddings(llm, texts), mean, rtol=0, atol=1e-12)
    for asked in (PoolingParams(normalize=True), PoolingParams(use_activation=True)):
        torch.testing.assert_close(embeddings(llm, texts, asked), F.normalize(mean, dim=1), rtol=0, atol=1e-12)


def test_sentence_bert_config_lower_cases_text_and_limits_a_decoder(tmp_path, bert):
    """Its do_lower_case (the tokenizer lower-cases text, special tokens kept) and max_seq_length (a decoder's
    default max_model_len too), as vLLM reads them."""
    folder = shutil.copytree(bert, tmp_path / "lower")
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 32, "do_lower_case": true}')
    llm = LLM(str(folder), dtype="float64")
    tok = llm.get_tokenizer()
    assert tok.encode("The CACHE is HOT [SEP] x") == tok.encode("the cache is hot [SEP] x")
    assert "[SEP]" in tok.convert_ids_to_tokens(tok.encode("a [SEP] b"))[1:-1]
    torch.testing.assert_close(embeddings(llm, ["The Cache IS Hot"]), embeddings(llm, ["the cache is hot"]),
                               rtol=0, atol=0)
    decoder = tmp_path / "decoder"
    save_model("flock/tiny", decoder)
    (decoder / "sentence_bert_config.json").write_text('{"max_seq_length": 24}')
    assert LLM(str(decoder)).engine.max_model_len == 24


def test_single_texts_are_segment_0_and_pairs_cut_longest_first(bert, bert_cross_encoder):
    """A single text's token types are all 0, a [SEP] in its text included (the tokenizer's); a pair's
    truncate_prompt_tokens cuts the longer text first, as the tokenizer's pair truncation (vLLM's); a prompt of
    ids cut from the right keeps its closing [SEP] only where it ends with one."""
    text = "the cache [SEP] is hot"
    (hidden,) = reference(bert, [text])
    torch.testing.assert_close(embeddings(LLM(str(bert), dtype="float64"), [text]), F.normalize(hidden[:1], dim=1),
                               rtol=0, atol=1e-12)
    query, doc = " ".join(sentences(5, count=2)), "blocks of the cache"
    tok = LLM(str(bert_cross_encoder)).get_tokenizer()
    encoded = tok(query, text_pair=doc, truncation=True, max_length=12)
    expected = reference(bert_cross_encoder, [(tok.decode(encoded["input_ids"][1:encoded["input_ids"].index(
        tok.sep_token_id)]), doc)])[0].sigmoid().item()
    llm = LLM(str(bert_cross_encoder), dtype="float64")
    got = llm.score(query, [doc], PoolingParams(truncate_prompt_tokens=12), use_tqdm=False)[0]
    assert got.prompt_token_ids == encoded["input_ids"] and got.outputs.score == pytest.approx(expected, abs=1e-12)
    ids = [10, 11, 12, 13, 14, 15]
    embed = LLM(str(bert), dtype="float64")
    assert embed.embed({"prompt_token_ids": ids}, PoolingParams(truncate_prompt_tokens=3))[0].prompt_token_ids == \
        [10, 11, 12]
    closed = [tok.cls_token_id, *ids, tok.sep_token_id]
    assert embed.embed({"prompt_token_ids": closed}, PoolingParams(truncate_prompt_tokens=3))[0].prompt_token_ids \
        == [tok.cls_token_id, 10, tok.sep_token_id]


def test_offline_pooling_takes_vllms_keywords(bert, bert_cross_encoder, tmp_path):
    """vLLM 0.32's LLM.embed / classify / encode / score keywords: tokenization_kwargs, lora_request (refused by
    name: adapters generate), score's chat_template; a tokenizer's truncation_side is the default side."""
    llm = LLM(str(bert), dtype="float64")
    text = "the cache is hot and the pool is long"
    cut = llm.embed(text, tokenization_kwargs={"truncate_prompt_tokens": 4})[0]
    assert cut.prompt_token_ids == llm.get_tokenizer().encode(text)[:3] + [llm.get_tokenizer().sep_token_id]
    bare = llm.encode(text, pooling_task="embed", tokenization_kwargs={"add_special_tokens": False})[0]
    assert bare.prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="adapters generate"):
        llm.embed(text, lora_request=LoRARequest("a", 1, "/x"))
    with pytest.raises(ValueError, match="tokenization_kwargs takes"):
        llm.embed(text, tokenization_kwargs={"padding": True})
    left = shutil.copytree(bert, tmp_path / "left")
    config = json.loads((left / "tokenizer_config.json").read_text())
    (left / "tokenizer_config.json").write_text(json.dumps(config | {"truncation_side": "left"}))
    ids = list(range(10, 16))
    assert LLM(str(left)).embed({"prompt_token_ids": ids}, PoolingParams(truncate_prompt_tokens=3))[0] \
        .prompt_token_ids == [13, 14, 15]
    cross = LLM(str(bert_cross_encoder), dtype="float64")
    template = "{{ messages[0]['content'] }} vs {{ messages[1]['content'] }}"
    scored = cross.score("blocks", ["cache"], chat_template=template, use_tqdm=False)[0]
    assert scored.prompt_token_ids == cross.get_tokenizer()("blocks vs cache")["input_ids"]


def test_sentence_transformers_modules_it_cannot_run_are_refused(tmp_path):
    folder = save_encoder(tmp_path / "dense", "bert", pooling="pooling_mode_mean_tokens")
    (folder / "modules.json").write_text(folder.joinpath("modules.json").read_text().replace("Normalize", "Dense"))
    with pytest.raises(ValueError, match="module Dense .* is not supported"):
        LLM(str(folder))
    decoder = tmp_path / "decoder"  # a decoder's vectors: its last token's only
    save_model("flock/tiny", decoder)
    for path in ("modules.json", "1_Pooling"):
        shutil.copytree(folder / path, decoder / path) if path == "1_Pooling" else shutil.copy(folder / path, decoder)
    (decoder / "modules.json").write_text(folder.joinpath("modules.json").read_text().replace("Dense", "Normalize"))
    with pytest.raises(ValueError, match="sentence-transformers pools MEAN here"):
        LLM(str(decoder))


def test_classifier_probabilities_equal_transformers(xlmr_classifier):
    texts = sentences(2)
    logits = torch.stack(reference(xlmr_classifier, texts))
    llm = LLM(str(xlmr_classifier), dtype="float64", max_num_batched_tokens=16)
    probs = torch.tensor([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)], dtype=torch.float64)
    torch.testing.assert_close(probs, logits.softmax(-1), rtol=0, atol=1e-12)
    raw = llm.classify(texts[:3], PoolingParams(use_activation=False), use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in raw], dtype=torch.float64), logits[:3],
                               rtol=0, atol=1e-12)


def test_cross_encoder_scores_pairs_with_their_token_types(bert_cross_encoder):
    query, docs = "where do the blocks of the cache come from", sentences(3, count=5)
    expected = [x.sigmoid().item() for x in reference(bert_cross_encoder, [(query, d) for d in docs])]
    for dtype, atol in (("float64", 1e-12), ("float32", 1e-6), ("bfloat16", 3e-2)):
        llm = LLM(str(bert_cross_encoder), dtype=dtype)
        scores = [s.outputs.score for s in llm.score(query, docs, use_tqdm=False)]
        assert scores == pytest.approx(expected, abs=atol, rel=0)


def test_what_an_encoder_cannot_do_is_refused(bert, bert_cross_encoder):
    with pytest.raises(ValueError, match="base model without an LM head"):
        LLM(str(bert)).generate(["the water"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="is a sequence classifier"):
        LLM(str(bert_cross_encoder)).embed(["the water"])
    for keyword in ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, {"enable_lora": True},
                    {"kv_cache_disk_dir": "kv"}):
        with pytest.raises(ValueError, match="is a bidirectional encoder"):
            LLM(str(bert), **keyword)
    too_long = " ".join(["water"] * 70)
    llm = LLM(str(bert), dtype="float64")
    with pytest.raises(ValueError, match=r"length is 64 tokens \(max_model_len\)\. However, your prompt contains 72"):
        llm.embed([too_long])
    (cut,) = llm.embed([too_long], PoolingParams(truncate_prompt_tokens=10))  # as the tokenizer truncates
    assert cut.prompt_token_ids == llm.get_tokenizer()(too_long, truncation=True, max_length=10)["input_ids"]
    (full,) = llm.embed([" ".join(["water"] * 62)])  # the longest prompt its positions hold
    assert len(full.prompt_token_ids) == 64


def test_batch_lines_embed_and_rerank(tmp_path, bert, bert_cross_encoder):
    import json

    from flock.api.batch import JobConfig, run_job
    from flock.config import EngineConfig
    from flock.engine.engine import LLMEngine

    query, docs = "the water is hot", sentences(4, count=3)
    for folder, url, body in ((bert, "/v1/embeddings", {"input": docs}),
                              (bert, "/pooling", {"input": docs, "task": "token_embed"}),
                              (bert_cross_encoder, "/v1/rerank", {"query": query, "documents": docs})):
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body}) + "\n")
        engine = LLMEngine(EngineConfig.from_kwargs(model=str(folder), dtype="float32", scheduler="batchllm"))
        assert run_job(JobConfig(str(inp), str(out), overwrite=True, quiet=True), engine) == 0
        (record,) = [json.loads(x) for x in out.read_text().splitlines()]
        data = record["response"]["body"]
        llm = LLM(str(folder), dtype="float32")
        if url == "/v1/embeddings":
            expected = [e.outputs.embedding for e in llm.embed(docs, use_tqdm=False)]
            assert [d["embedding"] for d in data["data"]] == [pytest.approx(e, abs=1e-6) for e in expected]
        elif url == "/pooling":  # a vector of each token
            expected = llm.encode(docs, pooling_task="token_embed", use_tqdm=False)
            for d, e in zip(data["data"], expected):
                torch.testing.assert_close(torch.tensor(d["data"]), e.outputs.data.float(), rtol=0, atol=1e-6)
        else:
            scores = [s.outputs.score for s in llm.score(query, docs, use_tqdm=False)]
            assert {r["index"]: r["relevance_score"] for r in data["results"]} == \
                pytest.approx(dict(enumerate(scores)), abs=1e-6)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "modernbert"])
def test_token_classifiers_equal_transformers(tmp_path, kind):
    """A named-entity tagger's probabilities of every token (LLM.encode, task token_classify)."""
    folder = (save_modernbert(tmp_path / kind, num_labels=5, seed=5, architectures=["ModernBertForTokenClassification"])
              if kind == "modernbert" else save_encoder(tmp_path / kind, kind, num_labels=5, seed=5,
                                                         token_classifier=True))
    texts = sentences(8, count=5)
    llm = LLM(str(folder), dtype="float64", max_num_batched_tokens=24)
    outs = llm.encode(texts, pooling_task="token_classify", use_tqdm=False)
    for out, logits in zip(outs, reference(folder, texts)):
        assert out.outputs.data.shape == (len(out.prompt_token_ids), 5)
        torch.testing.assert_close(out.outputs.data, logits.softmax(-1), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="is a token classifier"):
        llm.classify(texts[:1])


def test_token_embeddings_are_each_tokens_final_state(bert):
    texts = sentences(9, count=4)
    llm = LLM(str(bert), dtype="float64", max_num_batched_tokens=16, hf_overrides={"is_matryoshka": True})
    tokens = llm.encode(texts, pooling_task="token_embed", use_tqdm=False)
    for out, hidden in zip(tokens, reference(bert, texts)):
        torch.testing.assert_close(out.outputs.data, F.normalize(hidden, dim=-1), rtol=0, atol=1e-12)
    mixed = llm.encode(texts[:2], PoolingParams(normalize=False, dimensions=4), pooling_task="token_embed")
    torch.testing.assert_close(mixed[1].outputs.data, reference(bert, texts[1:2])[0][:, :4], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="gives no token embeddings"):
        LLM("flock/tiny").encode(["a b"], pooling_task="token_embed")
