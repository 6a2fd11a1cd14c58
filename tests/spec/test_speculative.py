"""Speculative decoding (n-gram drafts, verified in the next step) never changes a greedy output: under every
scheduler and attention backend the tokens are transformers', with drafts confirmed and refused on the way; the
sampling fields that read the output so far read the drafts before each row."""

import random

import pytest
import torch

from flock import LLM, SamplingParams
from flock.config import EngineConfig
from flock.sched import SCHEDULERS
from tests.engine.test_parity import assert_no_leak, hf_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
NEW = 24


def repetitive_prompts(seed: int, vocab: int = 8192) -> list[list[int]]:
    """A shared document with repeated motifs (drafts find matches), unrelated prompts ending in one, a prompt
    that repeats its own start."""
    rng = random.Random(seed)
    motif = [rng.randrange(vocab) for _ in range(6)]
    doc = [rng.randrange(vocab) for _ in range(20)]
    prompts = [doc + motif * 3 + motif[:k] for k in range(1, 5)]
    prompts += [[rng.randrange(vocab) for _ in range(n)] + motif * 2 for n in (3, 11)]
    prompts.append(doc[:9] + doc)
    return prompts


@pytest.fixture(scope="module")
def reference(hf_folders):
    cache = {}

    def get(kind):
        if kind not in cache:
            prompts = repetitive_prompts(len(kind))
            cache[kind] = prompts, hf_greedy(hf_folders[kind], prompts, max_new=NEW)
        return cache[kind]

    return get


def run(folder, prompts, params=None, **config) -> tuple[list, LLM]:
    llm = LLM(str(folder), dtype=config.pop("dtype", "float64"), **config)
    params = params or SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs, llm


def assert_drafts_both_ways(llm: LLM) -> None:
    stats = llm.stats()
    assert 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"]


@pytest.mark.parametrize("attention", ["torch", "torch-cascade", "cpu"])
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_greedy_with_drafts_matches_transformers(hf_folders, reference, scheduler, attention):
    prompts, expected = reference("llama")
    outs, llm = run(hf_folders["llama"], prompts, scheduler=scheduler, attention=attention, block_size=8,
                    speculative_config=SPEC)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_drafts_both_ways(llm)
    assert llm.stats()["steps"] < NEW + 2  # fewer steps than tokens
    assert_no_leak(llm)


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "phi3", "qwen3_moe"])
def test_other_families(hf_folders, reference, kind):
    prompts, expected = reference(kind)
    outs, llm = run(hf_folders[kind], prompts, block_size=8, speculative_config=SPEC)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["draft_tokens"] > 0


@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm"])
def test_drafts_under_small_budgets_and_preemption(hf_folders, reference, scheduler):
    """Token budgets that cut drafts short, a KV pool that preempts, blocks of 4 that drafts cross."""
    prompts, expected = reference("llama")
    outs, llm = run(hf_folders["llama"], prompts, scheduler=scheduler, block_size=4, num_kv_blocks=24,
                    max_num_batched_tokens=9, speculative_config=SPEC)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["preemptions"] > 0 and llm.stats()["draft_tokens"] > 0
    assert_no_leak(llm)


def test_prefix_cache_holds_only_confirmed_tokens(hf_folders, reference):
    """A conversation's next turn (prompt + output + more) reads the blocks its first turn wrote with drafts in
    them, and gives what an engine without a cache gives."""
    prompts, expected = reference("llama")
    llm = LLM(str(hf_folders["llama"]), dtype="float64", block_size=4, speculative_config=SPEC)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    turns = [p + e + [7, 8, 9] for p, e in zip(prompts, expected)]
    outs = llm.generate([{"prompt_token_ids": t} for t in turns], params, use_tqdm=False)
    assert llm.stats()["cached_prefill_tokens"] > 0
    fresh, _ = run(hf_folders["llama"], turns, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fresh]


@pytest.mark.parametrize("penalty", [0.02, 0.1])
def test_penalties_logprobs_and_min_tokens_read_the_drafts(hf_folders, reference, penalty):
    """Rows after drafts see them as output: repetition, frequency and presence penalties, min_tokens; logprobs
    come from each row's logits. (Mild penalties let drafts through; strong ones refuse what they repeat.)"""
    prompts, _ = reference("llama")
    params = SamplingParams(temperature=0, max_tokens=NEW, repetition_penalty=1 + penalty, frequency_penalty=penalty,
                            presence_penalty=penalty / 2, min_tokens=6, logprobs=3, stop_token_ids=[1, 2, 3])
    base, _ = run(hf_folders["llama"], prompts, params)
    outs, llm = run(hf_folders["llama"], prompts, params, speculative_config=SPEC)
    assert llm.stats()["draft_tokens"] > 0
    for got, want in zip(outs, base):
        g, w = got.outputs[0], want.outputs[0]
        assert g.token_ids == w.token_ids
        assert [[t for t, _ in e.top] for e in g.logprobs] == [[t for t, _ in e.top] for e in w.logprobs]
        assert [e.logprob for e in g.logprobs] == pytest.approx([e.logprob for e in w.logprobs], abs=1e-9)
    if penalty < 0.1:
        assert llm.stats()["accepted_draft_tokens"] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8])
def test_stops_and_length_caps_inside_drafts(hf_folders, reference, max_tokens):
    """A stop token or max_tokens reached within a step's confirmed drafts ends the output there."""
    prompts, expected = reference("llama")
    stop = [e[4] for e in expected]
    for p, stop_id in ((SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), None),
                       (SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=stop, ignore_eos=True), stop)):
        base, _ = run(hf_folders["llama"], prompts, p)
        outs, llm = run(hf_folders["llama"], prompts, p, speculative_config=SPEC)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
        assert [o.outputs[0].finish_reason for o in outs] == [o.outputs[0].finish_reason for o in base]
        assert_no_leak(llm)
    assert max(len(o.outputs[0].token_ids) for o in outs) <= NEW


def test_max_model_len_bounds_the_drafts(hf_folders, reference):
    prompts, _ = reference("llama")
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    base, _ = run(hf_folders["llama"], prompts, params, max_model_len=60)
    outs, _ = run(hf_folders["llama"], prompts, params, max_model_len=60, speculative_config=SPEC)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 60 for o in outs)


def test_seeded_sampling_with_drafts_is_the_same_in_any_batch(hf_folders, reference):
    """A seeded request's tokens with drafts are its tokens without them, alone or in a batch, however many
    drafts its steps carry (token budgets cut them short): a refused draft's row draws nothing for later tokens."""
    prompts, _ = reference("llama")
    params = SamplingParams(temperature=0.7, top_k=4, max_tokens=NEW, ignore_eos=True, seed=11)
    expected = run(hf_folders["llama"], prompts[2:3], params, dtype="float32")[0][0].outputs[0].token_ids
    together, llm = run(hf_folders["llama"], prompts, params, dtype="float32", speculative_config=SPEC)
    assert together[2].outputs[0].token_ids == expected
    assert_drafts_both_ways(llm)
    for budget in (2, 3, 6):
        alone, _ = run(hf_folders["llama"], prompts[2:3], params, dtype="float32", speculative_config=SPEC,
                       max_num_batched_tokens=budget)
        assert alone[0].outputs[0].token_ids == expected, budget


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "tags": {"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("spec", [{"regex": "(ab ){5}x"}, {"json": SCHEMA}, {"choice": ["alpha beta", "alpha gamma"]}])
def test_structured_outputs_with_drafts(spec):
    """A grammar's forced tokens (jump-forward) and n-gram drafts it allows are verified under its masks, each
    row's mask after the drafts before it: the same output as without drafts, inside the grammar."""
    import json

    from flock import StructuredOutputsParams

    prompts = ["ab ab ab ab", '{"name": "ab", "tags": ["ab", "cd"]} {"name": "', "alpha beta alpha"]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(**spec))
    base = LLM("flock/tiny", dtype="float32").generate(prompts, params)
    llm = LLM("flock/tiny", dtype="float32", speculative_config=SPEC)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert llm.stats()["accepted_draft_tokens"] > 0
    for o in outs:
        text = o.outputs[0].text
        if "json" in spec:
            assert set(json.loads(text)) == {"name", "tags"}
        elif "regex" in spec:
            assert text == "ab " * 5 + "x"
        else:
            assert text in spec["choice"]


def test_speculative_config_is_checked():
    with pytest.raises(ValueError, match="method='eagle'.*ngram"):
        EngineConfig.from_kwargs("flock/tiny", speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig.from_kwargs("flock/tiny", speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="no method"):
        EngineConfig.from_kwargs("flock/tiny", speculative_config={"num_speculative_tokens": 2})
    for zero in ({"prompt_lookup_min": 0, "prompt_lookup_max": 2}, {"prompt_lookup_max": 0}):
        with pytest.raises(ValueError, match="must be a positive integer, got 0"):
            EngineConfig.from_kwargs("flock/tiny", speculative_config={"method": "[ngram]", "num_speculative_tokens": 2,
                                                                       **zero})
    with pytest.raises(ValueError, match="prompt_lookup_min=4 must be <= prompt_lookup_max=2"):
        EngineConfig.from_kwargs("flock/tiny", speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['draft_tensor_parallel_size'\]"):
        EngineConfig.from_kwargs("flock/tiny", speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1})
    spec = EngineConfig.from_kwargs("flock/tiny", speculative_config={"model": "[ngram]", "num_speculative_tokens": 2,
                                                                      "prompt_lookup_max": 4}).speculative()
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 4, 4)


def test_cli_flag_takes_vllm_json():
    import argparse

    from flock.engine.args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p, "fcfs")
    args = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine_kwargs(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", "ngram"])


def test_server_streams_the_same_tokens_and_counts_drafts():
    """`flock serve --speculative-config` (vLLM's flag): a stream carries several tokens per step where drafts
    hold, the text equals the offline engine's without drafts, and /metrics has vLLM's spec_decode counters."""
    import json

    import httpx

    from bench.harness.server_process import ServerProcess
    from tests.api.test_server import metrics

    prompt = "one two three one two three one two three one two"
    expected = LLM("flock/tiny").generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    with ServerProcess("--model", "flock/tiny", "--speculative-config", json.dumps(SPEC),
                       env={"OMP_NUM_THREADS": "1"}) as s:
        body = {"model": "flock/tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        whole = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).json()
        chunks = []
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
        m = metrics(s)
    assert whole["choices"][0]["text"] == "".join(chunks) == expected[0].outputs[0].text
    drafts = next(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_draft_tokens_total"))
    accepted = next(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert drafts >= accepted > 0
    assert len(chunks) < 40  # steps that confirmed drafts sent several tokens at once


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2"])
def test_cpu_kernel_with_drafts_in_mixed_steps(hf_folders, kind):
    """float32 on the fused paths and the cpu kernel (which float64 leaves for torch-cascade): a small token budget
    mixes prefill chunks with decoding requests' drafts in one step; the tokens are transformers' float32 ones."""
    from flock.attention import cpu

    if cpu.kernel_unavailable(cpu.chosen_isa() or "avx2"):
        pytest.skip("no cpu kernel here")
    prompts = repetitive_prompts(len(kind))
    expected = hf_greedy(hf_folders[kind], prompts, dtype=torch.float32, max_new=NEW)
    outs, llm = run(hf_folders[kind], prompts, dtype="float32", attention="cpu", block_size=8,
                    max_num_batched_tokens=24, speculative_config=SPEC)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["accepted_draft_tokens"] > 0 and llm.engine.runner.backend.name.startswith("cpu")
    assert_no_leak(llm)


def test_drafts_per_batch_size(hf_folders, reference):
    """vLLM's num_speculative_tokens_per_batch_size: no drafts while 7 requests decode together, drafts for one
    alone; the tokens are transformers' either way."""
    prompts, expected = reference("llama")
    spec = SPEC | {"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 3, 1], [5, 6, 0]]}
    outs, llm = run(hf_folders["llama"], prompts, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["draft_tokens"] == 0
    outs, llm = run(hf_folders["llama"], prompts[:1], speculative_config=spec)
    assert outs[0].outputs[0].token_ids == expected[0] and llm.stats()["draft_tokens"] > 0
    config = EngineConfig.from_kwargs("flock/tiny", speculative_config=spec).speculative()
    assert [config.drafts_for(n) for n in (1, 2, 3, 4, 5, 7, 100)] == [3, 1, 1, 1, 0, 0, 0]  # gaps and tail carry


@pytest.mark.parametrize("schedule, why", [
    ([], "non-empty list"), ([[1, 2]], "3 integers"), ([[2, 4, 1]], "must start at batch size 1"),
    ([[1, 4, 1], [3, 8, 0]], "overlap"), ([[1, 4, -1]], "drafts >= 0"), ([[3, 1, 1]], "range_start <= range_end")])
def test_drafts_per_batch_size_is_checked(schedule, why):
    with pytest.raises(ValueError, match=f"num_speculative_tokens_per_batch_size.*{why}"):
        EngineConfig.from_kwargs("flock/tiny", speculative_config=SPEC | {
            "num_speculative_tokens_per_batch_size": schedule})
