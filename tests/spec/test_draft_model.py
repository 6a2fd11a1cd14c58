"""Speculative decoding with a draft model (vLLM's `draft_model` method): a small model drafts greedily on its own
KV cache, the target verifies; greedy outputs stay transformers' under every scheduler and attention backend, with
drafts confirmed and refused on the way, prompts read in chunks, requests preempted, and the draft's blocks all
returned."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flock import LLM, SamplingParams
from flock.config import EngineConfig
from flock.sched import SCHEDULERS
from tests.engine.test_parity import assert_no_leak
from tests.spec.test_speculative import NEW, repetitive_prompts, run


def draft_spec(model, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, **extra}


def perturbed(folder, out, scale: float):
    """The model of `folder` with noise of `scale` added to every matrix: a draft that agrees with it often, not
    always."""
    out.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    weights = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    save_file({name: w + scale * torch.randn(w.shape, generator=gen) if w.dim() > 1 else w
               for name, w in weights.items()}, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def near_draft(hf_folders, tmp_path_factory):
    return perturbed(hf_folders["llama"], tmp_path_factory.mktemp("draft") / "near", 0.01)


@pytest.fixture(scope="module")
def expected(hf_folders):
    from tests.engine.test_parity import hf_greedy

    prompts = repetitive_prompts(5)
    return prompts, hf_greedy(hf_folders["llama"], prompts, max_new=NEW)


def assert_draft_pool_free(llm: LLM) -> None:
    pool = llm.engine.proposer.kv.pool
    assert pool.num_free == pool.num_blocks and not llm.engine.proposer.sequences


@pytest.mark.parametrize("scheduler, attention", [(s, "torch") for s in sorted(SCHEDULERS)]
                         + [("fcfs", "torch-cascade"), ("batchllm", "cpu")])
def test_greedy_with_a_draft_model_matches_transformers(hf_folders, near_draft, expected, scheduler, attention):
    prompts, want = expected
    outs, llm = run(hf_folders["llama"], prompts, scheduler=scheduler, attention=attention, block_size=8,
                    speculative_config=draft_spec(near_draft))
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.stats()
    assert 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"]
    assert_no_leak(llm)
    assert_draft_pool_free(llm)


def test_the_target_as_its_own_draft_confirms_every_draft(hf_folders, expected):
    prompts, want = expected
    outs, llm = run(hf_folders["llama"], prompts, speculative_config=draft_spec(hf_folders["llama"], k=4))
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.stats()
    assert stats["accepted_draft_tokens"] == stats["draft_tokens"] > 0
    assert stats["steps"] <= 1 + -(-NEW // 5) + 1  # the prompt step, then 5 tokens a step


@pytest.mark.parametrize("draft", ["qwen3", "phi3"])
def test_a_draft_of_another_family(hf_folders, expected, draft):
    """Any generating model of the same vocabulary drafts: another architecture, head size and window."""
    prompts, want = expected
    outs, llm = run(hf_folders["llama"], prompts, speculative_config=draft_spec(hf_folders[draft], k=2))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats()["draft_tokens"] > 0


@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm"])
def test_small_budgets_and_preemption(hf_folders, near_draft, expected, scheduler):
    """Token budgets that split the draft's prompt reading and cut drafts short, a KV pool that preempts (the
    draft's as small), blocks of 4 that drafts cross."""
    prompts, want = expected
    outs, llm = run(hf_folders["llama"], prompts, scheduler=scheduler, block_size=4, num_kv_blocks=24,
                    max_num_batched_tokens=9, speculative_config=draft_spec(near_draft))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats()["preemptions"] > 0 and llm.stats()["accepted_draft_tokens"] > 0
    assert llm.engine.proposer.kv.pool.num_blocks == 24
    assert_no_leak(llm)
    assert_draft_pool_free(llm)


def test_the_draft_reads_a_shared_prefix_once(hf_folders, near_draft):
    """Requests that share a document: the draft's own prefix cache holds it, so its blocks are read once; without
    prefix caching every request reads it, and the tokens are the same."""
    prompts = [list(range(100, 164)) + [9, i, 7] for i in range(6)]

    def draft_reads(**config):
        outs, llm = run(hf_folders["llama"], prompts, block_size=8, max_num_seqs=1,
                        speculative_config=draft_spec(near_draft), **config)
        reads = llm.engine.proposer.computed_tokens
        assert llm.reset_prefix_cache() and not llm.engine.proposer.kv.pool.cached
        return [o.outputs[0].token_ids for o in outs], reads

    shared, fewer = draft_reads()
    alone, more = draft_reads(enable_prefix_caching=False)
    assert shared == alone
    assert more - fewer == 5 * 64


def test_seeded_sampling_is_the_same_in_any_batch(hf_folders, near_draft, expected):
    prompts, _ = expected
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=NEW, ignore_eos=True, seed=3)
    spec = draft_spec(near_draft)
    together, llm = run(hf_folders["llama"], prompts, params, dtype="float32", speculative_config=spec)
    alone, _ = run(hf_folders["llama"], prompts[3:4], params, dtype="float32", speculative_config=spec)
    assert together[3].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert llm.stats()["accepted_draft_tokens"] > 0


def test_a_quantized_gguf_draft(hf_folders, expected, tmp_path):
    """llama.cpp's common pairing: the target's own weights in Q8_0 blocks as its draft (kept quantized)."""
    from gguf import GGMLQuantizationType as Q

    from tests.model.gguf_files import write_gguf

    prompts, _ = expected
    draft = write_gguf(hf_folders["llama"], tmp_path / "draft.gguf", Q.Q8_0)
    base, _ = run(hf_folders["llama"], prompts, dtype="float32")
    outs, llm = run(hf_folders["llama"], prompts, dtype="float32", speculative_config=draft_spec(draft))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert llm.engine.proposer.runner.paths["quantized"].endswith("Q8_0")
    assert llm.stats()["draft_acceptance_rate"] > 0.5


def test_structured_outputs_and_stops_with_a_draft():
    from flock import StructuredOutputsParams

    prompts = ["ab ab ab ab", "alpha beta alpha", "one two three"]
    plain = LLM("flock/tiny", dtype="float32")
    llm = LLM("flock/tiny", dtype="float32", speculative_config=draft_spec("flock/tiny"))
    for params in (SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(
                       regex="(ab ){5}x")),
                   SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=30, stop=[" the"])):
        base = plain.generate(prompts, params)
        outs = llm.generate(prompts, params)
        assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs] == \
               [(o.outputs[0].text, o.outputs[0].finish_reason) for o in base]
        assert llm.stats()["accepted_draft_tokens"] > 0


def test_a_constrained_requests_drafts_are_verified_as_tokens():
    """Under a grammar, which drafts are kept (or replaced by the tokens it forces) depends on their values, so
    testing them against the draft's distribution would skew the draw: they carry none, and an unconstrained
    request's sampled drafts keep theirs."""
    from flock import StructuredOutputsParams

    llm = LLM("flock/tiny", dtype="float32", speculative_config=draft_spec("flock/tiny",
                                                                            draft_sample_method="probabilistic"))
    engine = llm.engine
    free = engine.add_request(list(range(30, 50)), SamplingParams(temperature=1.0, max_tokens=20, seed=1))
    bound = engine.add_request(list(range(30, 50)), SamplingParams(temperature=1.0, max_tokens=20, seed=1,
                                                                  structured_outputs=StructuredOutputsParams(
                                                                      regex="the quick brown fox")))
    engine.step()  # the prompts and their first tokens: drafts proposed after them
    assert free.draft_token_ids and len(free.draft_probs) == len(free.draft_token_ids)
    assert bound.draft_token_ids and bound.draft_probs is None
    while engine.has_unfinished():
        engine.step()


def test_draft_model_config_is_checked(hf_folders):
    def config(**spec):
        return EngineConfig.from_kwargs("flock/tiny", speculative_config=spec)

    with pytest.raises(ValueError, match="method='eagle'.*draft_model"):
        config(method="eagle", model="x", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative_config.model must name the draft model"):
        config(method="draft_model", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        config(model="flock/tiny", num_speculative_tokens=2, draft_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config.quantization must be one of"):
        config(model="flock/tiny", num_speculative_tokens=2, quantization="int3")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['prompt_lookup_max'\] for method 'draft_model'"):
        config(model="flock/tiny", num_speculative_tokens=2, prompt_lookup_max=3)
    spec = config(model=str(hf_folders["llama"]), num_speculative_tokens=2).speculative()
    assert (spec.method, spec.model, spec.quantization) == ("draft_model", str(hf_folders["llama"]), None)


def test_a_draft_that_does_not_generate_is_refused(hf_folders, tmp_path):
    folder = tmp_path / "encoder"
    folder.mkdir()
    for f in hf_folders["llama"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["LlamaModel"]}))
    with pytest.raises(ValueError, match="does not generate"):
        LLM(str(hf_folders["llama"]), speculative_config=draft_spec(folder))


def test_verifying_sampled_drafts_draws_from_the_targets_distribution():
    """Speculative sampling's rule (Sampler._verify): whatever distribution q the drafts come from, the kept or
    redrawn tokens follow the row's own p (top-k truncated here), and drafts are kept with chance sum min(p, q)."""
    from flock.sample.sampler import Sampler, distribution

    gen = torch.Generator().manual_seed(11)
    logits, n = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]), 40_000
    params = SamplingParams(temperature=0.9, top_k=5)
    p = distribution(logits[None], [params])[0]
    for q in (torch.tensor([0.05, 0.05, 0.3, 0.3, 0.2, 0.1]), p):
        drafts = torch.multinomial(q, n, replacement=True, generator=gen)
        tokens = Sampler(seed=3)(logits.repeat(n, 1), [params] * n, [None] * n,
                                 proposals=[(int(d), q) for d in drafts])
        freq = torch.bincount(tokens, minlength=6).double() / n
        assert freq.tolist() == pytest.approx(p.tolist(), abs=0.012)
        assert float((tokens == drafts).double().mean()) == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.012)


def test_probabilistic_drafts_of_the_target_itself_are_all_kept(hf_folders, expected):
    """The target as its own draft, sampling: drawn from the same distribution, every draft holds (q = p), where
    argmax drafts hold only when the draw picks them; a seeded request draws the same alone or batched."""
    prompts, _ = expected
    params = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True, seed=5)
    accepted = {}
    for method in ("greedy", "probabilistic"):
        spec = draft_spec(hf_folders["llama"], k=3, draft_sample_method=method)
        outs, llm = run(hf_folders["llama"], prompts, params, speculative_config=spec)
        stats = llm.stats()
        accepted[method] = stats["accepted_draft_tokens"] / stats["draft_tokens"]
        assert_draft_pool_free(llm)
    assert accepted["probabilistic"] == 1.0 and accepted["greedy"] < 0.9
    alone, _ = run(hf_folders["llama"], prompts[2:3], params, speculative_config=spec)
    assert alone[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_probabilistic_drafts_with_a_near_draft_keep_seeded_outputs_in_any_batch(hf_folders, near_draft, expected):
    prompts, _ = expected
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW, ignore_eos=True, seed=3)
    spec = draft_spec(near_draft, draft_sample_method="probabilistic")
    together, llm = run(hf_folders["llama"], prompts, params, dtype="float32", speculative_config=spec)
    alone, _ = run(hf_folders["llama"], prompts[1:2], params, dtype="float32", speculative_config=spec)
    assert together[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    stats = llm.stats()
    assert 0 < stats["accepted_draft_tokens"] <= stats["draft_tokens"]
    with pytest.raises(ValueError, match="draft_sample_method must be one of greedy, probabilistic"):
        EngineConfig.from_kwargs("flock/tiny", speculative_config=draft_spec("flock/tiny", draft_sample_method="x"))
