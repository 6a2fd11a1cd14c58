"""llama-server's /completion bodies (flock/api/llama_cpp.py) as engine requests: prompts, defaults, samplers,
penalties, logit biases and grammars."""

import pytest

from flock import LLM
from flock.api.llama_cpp import WHOLE_CONTEXT, parse_completion
from flock.api.protocol import APIError


@pytest.fixture(scope="module")
def tok():
    return LLM("flock/tiny", load_format="dummy").get_tokenizer()


def test_prompt_forms(tok):
    text = tok.encode("Hello world")
    one = parse_completion({"prompt": "Hello world"}, tok)
    assert one.single and one.requests[0][0] == text
    mixed = parse_completion({"prompt": [7, "Hello world", 9]}, tok)  # a string after an id gets no BOS
    assert mixed.single and mixed.requests[0][0] == [7, *tok.encode("Hello world", add_special_tokens=False), 9]
    several = parse_completion({"prompt": ["a", [5, 6], {"prompt_string": "b"}], "n_cmpl": 2}, tok)
    prompts = [ids for ids, _ in several.requests][::2]
    assert not several.single and prompts == [tok.encode("a"), [5, 6], tok.encode("b")]
    assert [p.seed for _, p in several.requests] == [None] * 6


def test_defaults_samplers_and_penalties(tok):
    p = parse_completion({"prompt": "x"}, tok).requests[0][1]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens) == (0.8, 40, 0.95, 0.05, None)
    assert p.penalty_last_n == 64 and p.repetition_penalty == 1.0 and p.temperature_last  # llama.cpp's chain
    first = parse_completion({"prompt": "x", "samplers": ["temperature", "top_k"]}, tok).requests[0][1]
    assert not first.temperature_last and parse_completion({"prompt": "x", "samplers": "kmt"},
                                                           tok).requests[0][1].temperature_last
    p = parse_completion({"prompt": "x", "temperature": -1, "top_k": 0, "n_predict": 5, "seed": 3,
                          "repeat_penalty": 1.2, "repeat_last_n": -1, "stop": "END"}, tok).requests[0][1]
    assert (p.temperature, p.top_k, p.max_tokens, p.seed, p.stop) == (0.0, -1, 5, 3, ["END"])
    assert p.repetition_penalty == 1.2 and p.penalty_last_n == WHOLE_CONTEXT
    p = parse_completion({"prompt": "x", "repeat_penalty": 1.2, "samplers": ["top-k", "Temp"]}, tok).requests[0][1]
    assert (p.top_p, p.min_p, p.repetition_penalty, p.top_k) == (1.0, 0.0, 1.0, 40)  # left out: off
    p = parse_completion({"prompt": "x", "samplers": "kp"}, tok).requests[0][1]
    assert (p.temperature, p.min_p) == (1.0, 0.0)  # no temperature sampler: the logits as they are
    p = parse_completion({"prompt": "x", "typical_p": 0.7, "top_n_sigma": 1.5, "xtc_probability": 0.5,
                          "xtc_threshold": 0.2}, tok).requests[0][1]
    assert (p.typical_p, p.top_n_sigma, p.xtc_probability, p.xtc_threshold) == (0.7, 1.5, 0.5, 0.2)
    p = parse_completion({"prompt": "x", "typical_p": 0.7, "xtc_probability": 0.5, "samplers": "kt"},
                         tok).requests[0][1]
    assert (p.typical_p, p.xtc_probability) == (1.0, 0.0)
    assert parse_completion({"prompt": "x", "n_predict": 0}, tok).prefill_only


def test_dry_and_dynamic_temperature(tok):
    p = parse_completion({"prompt": "x"}, tok).requests[0][1]
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n, p.dynatemp_range) == \
        (0.0, 1.75, 2, 64, 0.0) and p.dry_sequence_breakers == ["\n", ":", "\"", "*"]
    body = {"prompt": "x", "dry_multiplier": 0.8, "dry_base": 0.5, "dry_allowed_length": 3, "dry_penalty_last_n": -1,
            "dry_sequence_breakers": ["###"], "dynatemp_range": 0.3, "dynatemp_exponent": 2}
    c = parse_completion(body, tok)
    p = c.requests[0][1]
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.8, 1.75, 3, -1)
    assert p.dry_sequence_breakers == ["###"] and (p.dynatemp_range, p.dynatemp_exponent) == (0.3, 2)
    assert c.settings["samplers"][:2] == ["penalties", "dry"] and c.settings["dry_multiplier"] == 0.8
    p = parse_completion(body | {"samplers": "kt"}, tok).requests[0][1]
    assert p.dry_multiplier == 0.0 and p.dynatemp_range == 0.3  # no "d" in the chain: DRY off
    assert parse_completion(body | {"samplers": "kd"}, tok).requests[0][1].dynatemp_range == 0.0  # nor temperature
    p = parse_completion(body | {"mirostat": 2, "mirostat_tau": 4.0, "repeat_penalty": 1.3}, tok).requests[0][1]
    assert (p.mirostat, p.mirostat_tau, p.mirostat_eta) == (2, 4.0, 0.1)
    assert (p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.dry_multiplier, p.dynatemp_range) == \
        (-1, 1.0, 0.0, 1.0, 0.0, 0.0)  # llama.cpp's Mirostat chain: biases, temperature, Mirostat
    with pytest.raises(APIError, match="mirostat must be 0"):
        parse_completion({"prompt": "x", "mirostat": 3}, tok)


def test_logit_bias_and_grammar(tok):
    hello = tok.encode("Hello", add_special_tokens=False)
    p = parse_completion({"prompt": "x", "logit_bias": [[5, 1.5], ["Hello", False]]}, tok).requests[0][1]
    assert p.logit_bias == {5: 1.5} | {t: -100.0 for t in hello}
    p = parse_completion({"prompt": "x", "logit_bias": {"5": -2, "Hello": 1}}, tok).requests[0][1]
    assert p.logit_bias == {5: -2.0} | {t: 1.0 for t in hello}
    p = parse_completion({"prompt": "x", "json_schema": {"type": "object"}}, tok).requests[0][1]
    assert p.structured_outputs.json == {"type": "object"}
    assert parse_completion({"prompt": "x", "grammar": "root ::= \"a\""}, tok).requests[0][1].structured_outputs.grammar


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "mirostat": -1}, "mirostat"), ({"prompt": "x", "dry_sequence_breakers": []}, "dry_sequence_breakers"),
    ({"prompt": "x", "dry_allowed_length": -1}, "dry_allowed_length"),
    ({"prompt": "x", "lora": [{"id": 0, "scale": 1}]}, "lora"), ({"prompt": 3}, "prompt"),
    ({"prompt": "x", "n_cmpl": 0}, "n_cmpl"), ({"prompt": "x", "n_probs": 21}, "n_probs"),
    ({"prompt": "x", "logit_bias": [[1.5, 2]]}, "logit_bias"), ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "repeat_last_n": -3}, "repeat_last_n"), ({"prompt": "x", "samplers": 3}, "samplers")])
def test_refused_with_the_field(tok, body, param):
    with pytest.raises(APIError) as e:
        parse_completion(body, tok)
    assert e.value.param == param
