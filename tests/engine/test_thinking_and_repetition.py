"""vLLM's thinking_token_budget (a reasoning model's thinking ended by force once it has used its budget) and
repetition_detection (an output that ends in a repeated pattern stops, finish_reason "repetition")."""

import pytest

from flock import LLM, RepetitionDetectionParams, SamplingParams
from tests.conftest import VOCAB
from tests.engine.test_parity import model_greedy
from tests.spec.test_speculative import SPEC

THINK, END = VOCAB, VOCAB + 1  # the ids the thinking model's tokenizer gives <think> and </think>


@pytest.fixture(scope="module")
def hf_model(thinker):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(thinker, dtype=torch.float64).eval()


def generate(llm: LLM, prompts: list[list[int]], **params):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) if not params else \
        SamplingParams(**({"temperature": 0, "max_tokens": 12, "ignore_eos": True} | params))
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


PROMPTS = [[11, 12, 13, THINK], [21, 22, THINK, 23, 24], [31, 32, 33, 34, 35]]


@pytest.mark.parametrize("drafts", [None, "ngram", "self"])
@pytest.mark.parametrize("budget", [0, 1, 4])
def test_thinking_ends_by_force_after_its_budget(thinker, hf_model, budget, drafts):
    """A prompt that opens thinking: `budget` free tokens, then </think>, then what transformers continues with;
    a prompt that does not think is untouched. With drafts too: the rows after drafts count them (the model as its
    own draft proposes past the budget every time)."""
    spec = {"ngram": SPEC, "self": {"model": str(thinker), "num_speculative_tokens": 3}}.get(drafts)
    llm = LLM(str(thinker), dtype="float64", speculative_config=spec)
    free = [o.token_ids for o in generate(llm, PROMPTS)]
    outs = generate(llm, PROMPTS, thinking_token_budget=budget)
    for prompt, out, plain in zip(PROMPTS[:2], outs, free):
        ids = list(out.token_ids)
        assert END not in plain[:budget]  # (the model does not end it by itself first)
        assert ids[:budget] == plain[:budget] and ids[budget] == END
        rest = model_greedy(hf_model, [prompt + ids[: budget + 1]], len(ids) - budget - 1)[0]
        assert ids[budget + 1:] == rest
    assert outs[2].token_ids == free[2]
    assert generate(llm, PROMPTS, thinking_token_budget=-1)[0].token_ids == free[0]


def test_thinking_opened_by_the_output_and_closed_in_the_prompt(thinker):
    llm = LLM(str(thinker), dtype="float64")
    closed = [[11, THINK, 12, END, 13]]
    assert generate(llm, closed, thinking_token_budget=0)[0].token_ids == generate(llm, closed)[0].token_ids
    # the output opens it (logit_bias makes <think> the token it would always draw): with no budget, each opening
    # is ended by force
    out = generate(llm, [[5, 6, 7]], thinking_token_budget=0, logit_bias={THINK: 50.0}, max_tokens=6)
    assert out[0].token_ids == [THINK, END] * 3


def test_a_thinking_budget_needs_think_tokens():
    with pytest.raises(ValueError, match="thinking_token_budget needs a model whose tokenizer has <think> and"):
        LLM("flock/tiny").generate(["hi"], SamplingParams(thinking_token_budget=5))
    with pytest.raises(ValueError, match="thinking_token_budget must be an integer >= 0, or -1"):
        SamplingParams(thinking_token_budget=-2).validate()


@pytest.mark.parametrize("pattern", [[1, 2, 3, 1, 2, 3, 1, 2, 3], [9, 5, 5, 5], [4, 7, 8, 7, 8, 7, 8]])
def test_repeated_patterns_are_found(pattern):
    assert RepetitionDetectionParams(4, 0, 3).found(pattern)
    assert not RepetitionDetectionParams(4, 0, 3).found(pattern[:-1] + [99])
    assert not RepetitionDetectionParams(4, 0, 4).found(pattern)  # one repeat short


def test_a_repeating_output_stops_as_vllm_stops_it():
    llm = LLM("flock/tiny", dtype="float32")
    rep = {"max_pattern_size": 2, "min_count": 3}
    one = generate(llm, [[5, 6, 7]], allowed_token_ids=[42], repetition_detection=rep, max_tokens=20)[0]
    assert one.token_ids == [42, 42, 42] and one.finish_reason == "repetition"
    assert one.stop_reason == "repetition_detected" and one.text == llm.get_tokenizer().decode([42] * 3)
    later = generate(llm, [[5, 6, 7]], allowed_token_ids=[42], repetition_detection=rep, max_tokens=20, min_tokens=5)
    assert len(later[0].token_ids) == 5 and later[0].finish_reason == "repetition"
    short = generate(llm, [[5, 6, 7]], allowed_token_ids=[42], repetition_detection=rep, max_tokens=2)
    assert short[0].finish_reason == "length"
    off = generate(llm, [[5, 6, 7]], allowed_token_ids=[42], repetition_detection={"max_pattern_size": 0})
    assert len(off[0].token_ids) == 12 and off[0].finish_reason == "length"


@pytest.mark.parametrize("bad, why", [({"max_pattern_size": 2, "min_count": 1}, "min_count must be >= 2"),
                                      ({"max_pattern_size": 1, "min_pattern_size": 2, "min_count": 2}, "min_pattern"),
                                      ({"max_size": 2}, "must be an object of")])
def test_bad_repetition_detection_is_named(bad, why):
    with pytest.raises(ValueError, match=f"repetition_detection.*{why}"):
        SamplingParams(repetition_detection=bad).validate()


def test_the_server_takes_both_fields():
    import httpx

    from bench.harness.server_process import ServerProcess

    with ServerProcess("--model", "flock/tiny", env={"OMP_NUM_THREADS": "1"}) as s:
        body = {"model": "flock/tiny", "prompt": "one two", "max_tokens": 20, "temperature": 0,
                "allowed_token_ids": [42], "repetition_detection": {"max_pattern_size": 1, "min_count": 4}}
        choice = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("repetition", "repetition_detected")
        bad = httpx.post(f"{s.url}/v1/completions", json=body | {"repetition_detection": {"min_count": 1,
                                                                                           "max_pattern_size": 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_detection.min_count"
        chat = {"model": "flock/tiny", "messages": [{"role": "user", "content": "hi"}], "thinking_token_budget": 8}
        refused = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"
        unlimited = httpx.post(f"{s.url}/v1/chat/completions", json=chat | {"thinking_token_budget": -1,
                                                                             "max_tokens": 2}, timeout=60)
        assert unlimited.status_code == 200


def test_a_thinking_budget_with_a_grammar_from_the_start_is_refused(thinker):
    """Without a reasoning parser a grammar applies from the first token, and it would refuse the </think> the
    budget forces (the request ended as "abort"): refused by name; with one, the grammar waits for the thinking."""
    from flock import StructuredOutputsParams

    grammar = StructuredOutputsParams(regex="Hello")
    with pytest.raises(ValueError, match="thinking_token_budget with structured outputs needs a reasoning parser"):
        generate(LLM(str(thinker)), PROMPTS[:1], thinking_token_budget=1, structured_outputs=grammar)
    assert generate(LLM(str(thinker)), PROMPTS[2:], thinking_token_budget=1, structured_outputs=grammar,
                    ignore_eos=False)[0].text == "Hello"  # a prompt that does not think: no conflict
    out = generate(LLM(str(thinker), reasoning_parser="deepseek_r1"), PROMPTS[:1], thinking_token_budget=1,
                   structured_outputs=grammar, ignore_eos=False, max_tokens=8)[0]
    assert out.token_ids[1] == END and out.finish_reason == "stop" and out.text.endswith("Hello")


def test_a_model_may_stop_while_its_grammar_waits_for_the_thinking(thinker):
    """Under a reasoning parser the grammar starts after </think>; meanwhile the stop tokens stay allowed, as vLLM
    applies no grammar in the thinking (they were held back: such an answer ran to max_tokens)."""
    from flock import StructuredOutputsParams

    llm = LLM(str(thinker), reasoning_parser="deepseek_r1")
    eos = llm.get_tokenizer().eos_token_id
    grammar = StructuredOutputsParams(regex="Hello")
    out = generate(llm, PROMPTS[:1], structured_outputs=grammar, ignore_eos=False, logit_bias={eos: 100.0})[0]
    assert (out.token_ids, out.finish_reason) == ([eos], "stop")
    after = generate(llm, PROMPTS[:1], structured_outputs=grammar, ignore_eos=False, logit_bias={END: 100.0},
                     max_tokens=8)[0]  # the thinking ends at once: then the grammar holds
    assert after.token_ids[0] == END and after.text.endswith("Hello") and after.finish_reason == "stop"
