"""Embeddings (LLM.embed, PoolingParams): the last prompt token's final hidden state, L2-normalized, equal to
transformers' on the same weights under every scheduler, chunk size and prefix-cache state."""

import pytest
import torch

from flock import LLM, PoolingParams, SamplingParams
from tests.conftest import HF_CONFIGS, VOCAB
from tests.engine.test_parity import assert_no_leak, shared_prefix_prompts


@pytest.fixture(scope="module")
def base_qwen3(tmp_path_factory):
    """A Qwen3Model (no LM head, tensors without the "model." prefix), as Qwen3-Embedding checkpoints are saved."""
    from transformers import AutoConfig, AutoModel

    from flock.model.builtin import write_tokenizer

    spec = dict(HF_CONFIGS["qwen3"], tie_word_embeddings=False)
    config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=VOCAB, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None, **spec)
    torch.manual_seed(5)
    model = AutoModel.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("qwen3-embedding")
    model.save_pretrained(folder)
    write_tokenizer(folder, VOCAB)
    return folder


def reference(folder, prompts: list[list[int]], dims: int | None = None, normalize: bool = True) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            last = model(torch.tensor([p])).last_hidden_state[0, -1, :dims]
            out.append(torch.nn.functional.normalize(last, dim=0) if normalize else last)
    return torch.stack(out)


def embed(llm: LLM, prompts, params: PoolingParams | None = None) -> torch.Tensor:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs], dtype=torch.float64)


@pytest.mark.parametrize("scheduler, chunk", [("fcfs", 4096), ("fcfs", 7), ("batchllm", 24), ("feather", 16)])
def test_embeddings_equal_transformers_last_token(base_qwen3, scheduler, chunk):
    prompts = shared_prefix_prompts(seed=4)
    expected = reference(base_qwen3, prompts)
    llm = LLM(str(base_qwen3), dtype="float64", scheduler=scheduler, max_num_batched_tokens=chunk, block_size=4)
    torch.testing.assert_close(embed(llm, prompts), expected, rtol=0, atol=1e-10)
    assert llm.stats()["saving_rate"] > 0.2  # the shared prefixes' KV computed once
    again = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)  # from the prefix cache
    assert sum(o.num_cached_tokens for o in again) > 0
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in again], dtype=torch.float64), expected,
                               rtol=0, atol=1e-10)
    assert_no_leak(llm)


def test_dimensions_and_unnormalized(base_qwen3):
    """A Matryoshka model's shorter vectors (its config says it is one; vLLM's hf_overrides for Qwen3-Embedding),
    only the dimensions it lists where it lists them; another model's refused as vLLM refuses them."""
    prompts = shared_prefix_prompts(seed=4)[:3]
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        LLM(str(base_qwen3), dtype="float64").embed([[1, 2]], PoolingParams(dimensions=16))
    listed = LLM(str(base_qwen3), dtype="float64", hf_overrides={"matryoshka_dimensions": [16, 32]})
    with pytest.raises(ValueError, match=r"Matryoshka dimensions \[16, 32\], not 8"):
        listed.embed([[1, 2]], PoolingParams(dimensions=8))
    llm = LLM(str(base_qwen3), dtype="float64", hf_overrides={"is_matryoshka": True})
    got = embed(llm, prompts, PoolingParams(dimensions=16, normalize=False))
    torch.testing.assert_close(got, reference(base_qwen3, prompts, dims=16, normalize=False), rtol=0, atol=1e-10)
    short = embed(llm, prompts, PoolingParams(dimensions=16))
    torch.testing.assert_close(short.norm(dim=1), torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"request 0: dimensions must be an integer in \[1, 64\]"):
        llm.embed([[1, 2]], PoolingParams(dimensions=65))


def test_vllms_pooling_params_use_activation_truncation_and_one_each(base_qwen3):
    """vLLM 0.32's: use_activation False leaves an embedding unnormalized; a pooling prompt is cut from the right
    (its first tokens kept), to all max_model_len tokens for -1; a list of params gives each prompt its own."""
    prompts = [p[:30] for p in shared_prefix_prompts(seed=4)[:3]]
    llm = LLM(str(base_qwen3), dtype="float64", max_model_len=32, hf_overrides={"is_matryoshka": True})
    raw = embed(llm, prompts, PoolingParams(use_activation=False))
    torch.testing.assert_close(raw, embed(llm, prompts, PoolingParams(normalize=False)), rtol=0, atol=0)
    cut = llm.embed({"prompt_token_ids": prompts[0]}, PoolingParams(truncate_prompt_tokens=5))[0]
    assert cut.prompt_token_ids == prompts[0][:5]
    long = {"prompt_token_ids": list(range(40))}
    assert llm.embed(long, PoolingParams(truncate_prompt_tokens=-1))[0].prompt_token_ids == list(range(32))
    each = llm.embed([{"prompt_token_ids": p} for p in prompts[:2]], [PoolingParams(dimensions=4), PoolingParams()])
    assert [len(o.outputs.embedding) for o in each] == [4, 64]
    with pytest.raises(ValueError, match="got 1 pooling_params for 2 prompts"):
        llm.embed([{"prompt_token_ids": p} for p in prompts[:2]], [PoolingParams()])


def test_encode_is_embed_or_classify_by_task(base_qwen3):
    """vLLM's LLM.encode: the pooling task named (embed here), the vector as a tensor; no task is refused by name,
    and a token-level one on a decoder (an encoder's: tests/engine/test_encoders.py)."""
    prompts = shared_prefix_prompts(seed=4)[:2]
    llm = LLM(str(base_qwen3), dtype="float64")
    encoded = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False, pooling_task="embed")
    torch.testing.assert_close(torch.stack([e.outputs.data for e in encoded]), embed(llm, prompts), rtol=0, atol=0)
    for task, why in ((None, "pooling_task must be one of embed, classify"), ("token_embed", "no token embeddings")):
        with pytest.raises(ValueError, match=why):
            llm.encode([prompts[0]], pooling_task=task)


def test_a_base_model_embeds_and_refuses_to_generate(base_qwen3):
    llm = LLM(str(base_qwen3), dtype="float32")
    with pytest.raises(ValueError, match="base model without an LM head: it embeds"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert len(llm.embed("some text", use_tqdm=False)[0].outputs.embedding) == 64


@pytest.mark.parametrize("ops", ["auto", "torch"])
def test_a_causal_lm_embeds_beside_its_generations(hf_folders, ops):
    """Embedding and generation requests in the same steps: each gets what it gets alone (float32, fast paths
    on and off)."""
    from flock.engine.loop import run

    prompts = shared_prefix_prompts(seed=9)
    llm = LLM(str(hf_folders["qwen3"]), dtype="float32", ops=ops, max_num_batched_tokens=32, block_size=4)
    alone = embed(llm, prompts)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]
    engine = llm.engine
    mixed = [(engine.add_request(p, params), engine.add_request(p, PoolingParams())) for p in prompts]
    for _ in run(engine):
        pass
    assert [g.output_token_ids for g, _ in mixed] == tokens
    torch.testing.assert_close(torch.tensor([e.embedding for _, e in mixed], dtype=torch.float64), alone,
                               rtol=0, atol=1e-6)
    assert_no_leak(llm)


def test_score_is_the_cosine_of_transformers_embeddings(base_qwen3):
    """LLM.score (vLLM's, for an embedding model): one prompt against many, and pairs in order."""
    prompts = shared_prefix_prompts(seed=4)[:4]
    ref = reference(base_qwen3, prompts)
    llm = LLM(str(base_qwen3), dtype="float64")
    ids = [{"prompt_token_ids": p} for p in prompts]
    one = llm.score(ids[0], ids[1:], use_tqdm=False)
    assert [o.prompt_token_ids for o in one] == [prompts[0] + p for p in prompts[1:]]
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in one], dtype=torch.float64),
                               ref[1:] @ ref[0], rtol=0, atol=1e-10)
    pairs = llm.score(ids[:2], ids[2:], use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairs], dtype=torch.float64),
                               (ref[:2] * ref[2:]).sum(1), rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="data_1 must hold one prompt or as many as data_2"):
        llm.score(ids[:2], ids[:3])
