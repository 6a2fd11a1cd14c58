"""Beam search (vLLM's, flock/beam_search.py): the search's steps through the engine give what the same search
gives on transformers' float64 next-token distributions; its ranking and stopping as vLLM's."""

import pytest
import torch

from flock import LLM, SamplingParams
from flock.beam_search import BeamSearch, BeamSearchParams
from flock.sample.logprobs import TokenLogprobs
from tests.engine.test_parity import shared_prefix_prompts


def transformers_search(folder, prompt: list[int], params: BeamSearchParams, eos: list[int]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    search = BeamSearch(prompt, params, eos)
    with torch.no_grad():
        while not search.done:
            entries = []
            for tokens, _ in search.requests():
                logprobs = model(torch.tensor([tokens])).logits[0, -1].log_softmax(-1)
                top = logprobs.topk(2 * params.beam_width)
                entries.append(TokenLogprobs(int(top.indices[0]), float(top.values[0]), 1,
                                             list(zip(top.indices.tolist(), top.values.tolist()))))
            search.advance(entries)
    return search.result()


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beams_equal_the_same_search_on_transformers(hf_folders, width, length_penalty):
    prompts = shared_prefix_prompts(seed=5)[:3]
    params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=length_penalty)
    llm = LLM(str(hf_folders["llama"]), dtype="float64", block_size=4)
    got = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, got):
        expected = transformers_search(hf_folders["llama"], prompt, params, [])
        assert [b.tokens for b in out.sequences] == [b.tokens for b in expected]
        assert [b.cum_logprob for b in out.sequences] == pytest.approx([b.cum_logprob for b in expected], abs=1e-9)
        assert len(out.sequences) == width and all(b.finish_reason == "length" for b in out.sequences)
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    if width == 1:
        assert [o.sequences[0].output_token_ids for o in got] == [g.outputs[0].token_ids for g in greedy]
    assert llm.stats()["saving_rate"] > 0.5  # each step's requests read their beams' KV from the prefix cache


def test_eos_completes_a_beam_and_length_penalty_ranks():
    """A candidate ending in EOS leaves the search, complete; the rest go on; vLLM's score divides the cumulative
    logprob by the length (prompt included, a final EOS not) to the length_penalty."""
    search = BeamSearch([7, 8], BeamSearchParams(beam_width=2, max_tokens=3), eos_token_ids=[0])
    search.advance([TokenLogprobs(0, -0.1, 1, [(0, -0.1), (5, -0.5), (6, -1.0), (9, -3.0)])])
    assert [b.output_token_ids for b in search.completed] == [[0]] and search.completed[0].finish_reason == "stop"
    assert [b.output_token_ids for b in search.beams] == [[5], [6]]
    search.advance([TokenLogprobs(1, -0.2, 1, [(1, -0.2), (2, -0.3)]), TokenLogprobs(3, -0.1, 1, [(3, -0.1), (4, -4)])])
    assert [b.output_token_ids for b in search.beams] == [[5, 1], [5, 2]]
    best = search.result()
    assert [(b.output_token_ids, b.finish_reason) for b in best] == [([0], "stop"), ([5, 1], "length")]
    assert search.score(best[0]) == pytest.approx(-0.1 / 2) and search.score(best[1]) == pytest.approx(-0.7 / 4)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=3).validate()
    BeamSearchParams(beam_width=11, max_tokens=3).validate(max_logprobs=40)  # the engine's max_logprobs decides
    with pytest.raises(ValueError, match="structured_outputs"):
        BeamSearchParams(beam_width=2, max_tokens=3, structured_outputs={"regex": "a"}).validate()
    salted = BeamSearchParams(beam_width=2, max_tokens=3, cache_salt="tenant", priority=2).step_params()
    assert (salted.cache_salt, salted.priority, salted.logprobs, salted.max_tokens) == ("tenant", 2, 4, 1)


def test_vllm_arguments_the_context_and_concurrency_limit():
    """vLLM's beam_search(prompts, params, lora_request, use_tqdm, concurrency_limit): prompts searched a few at a
    time give what all at once give; a beam that reaches max_model_len ends there with "length"."""
    llm = LLM("flock/tiny", max_model_len=32, block_size=4)
    prompts = [[5 + i] * 8 for i in range(3)]
    params = BeamSearchParams(2, 6, True, 0.0, 1.0, False, None, False)  # vLLM's positional order
    together = llm.beam_search(prompts, params, None, False)
    assert [o.sequences for o in llm.beam_search(prompts, params, [None] * 3, concurrency_limit=2)] == \
        [o.sequences for o in together]
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search(prompts, params, [None])
    full = llm.beam_search([[5] * 28], BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True))[0]
    assert all(len(b.output_token_ids) == 4 and b.finish_reason == "length" for b in full.sequences)
