"""Structured outputs through xgrammar: every output of a constrained request fits its grammar (JSON schema,
JSON object, regex, choice, EBNF or Lark, structural tags) under every scheduler, attention backend and preemption; a constrained row never
changes the tokens of an unconstrained one; each distinct spec compiles once; bad specs are named errors."""

import json
import re

import jsonschema
import pytest
import torch

from flock import LLM, SamplingParams, StructuredOutputsParams
from flock.model import fused_ops
from flock.sample import grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham", "unsure"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "note": {"type": "string", "pattern": "^[a-z ]{0,6}$"},  # xgrammar's maxLength lets control characters in
    },
    "required": ["label", "score", "flags", "note"],
    "additionalProperties": False,
}
PROMPTS = ["Classify this message: win a prize now", "Rate it:", "A block table maps", "JSON please"]


def constrained(spec: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 0), max_tokens=kw.pop("max_tokens", 80),
                          structured_outputs=spec, **kw)


def assert_valid(spec: StructuredOutputsParams, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice


SPECS = [
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(regex=r"[0-9]{3}-(yes|no)"),
    StructuredOutputsParams(choice=["alpha", "beta gamma", "δ", "🎉"]),
    StructuredOutputsParams(grammar='root ::= "(" [a-c]{1,3} ")"'),
    StructuredOutputsParams(grammar='// Lark, as vLLM takes it too\nstart: "(" LETTERS ")"\nLETTERS: /[a-c]{1,3}/'),
    StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "(", "end": ")", "content": {"type": "regex", "pattern": "[a-c]{1,3}"}}})),
    StructuredOutputsParams(structural_tag=json.dumps({  # vLLM's earlier form
        "type": "structural_tag", "triggers": ["("], "structures": [{"begin": "(", "schema": {"enum": [1, 2]},
                                                                     "end": ")"}]})),
]


@pytest.fixture(scope="module")
def tiny():
    return LLM("flock/tiny", num_kv_blocks=512)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_outputs_fit_the_grammar_and_stop(tiny, spec):
    outs = tiny.generate(PROMPTS, [constrained(spec), constrained(spec, temperature=1.0, seed=1)] * 2, use_tqdm=False)
    if spec.structural_tag and "structures" in spec.structural_tag:  # free text around tags: it need not stop
        for o in outs:
            assert all(m in ("(1)", "(2)") for m in re.findall(r"\([^)]*\)", o.outputs[0].text))
        return
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        text = o.outputs[0].text
        assert_valid(spec, text)
        if spec.kind == "grammar" or (spec.kind == "structural_tag" and "structures" not in spec.structural_tag):
            assert re.fullmatch(r"\([a-c]{1,3}\)", text)


@pytest.mark.parametrize("scheduler", ["fcfs", "lpm", "batchllm", "feather"])
@pytest.mark.parametrize("attention", ["torch", "torch-cascade", "auto"])
def test_every_scheduler_and_backend_keeps_the_grammar_and_the_plain_rows(scheduler, attention):
    llm = LLM("flock/tiny", num_kv_blocks=512, scheduler=scheduler, attention=attention, block_size=4)
    shared = "You are a classifier. Answer in JSON. " * 3
    prompts = [shared + p for p in PROMPTS]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    spec = StructuredOutputsParams(json=SCHEMA)
    mixed = llm.generate(prompts * 2, [plain] * 4 + [constrained(spec)] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone
    for o in mixed[4:]:
        assert_valid(spec, o.outputs[0].text)


def test_preempted_requests_stay_in_their_grammar():
    llm = LLM("flock/tiny", num_kv_blocks=24, block_size=4, max_num_batched_tokens=32)
    spec = StructuredOutputsParams(json=SCHEMA)
    outs = llm.generate([p * 3 for p in PROMPTS] * 2, constrained(spec, temperature=1.0, seed=5), use_tqdm=False)
    assert llm.stats()["preemptions"] > 0
    for o in outs:
        assert_valid(spec, o.outputs[0].text)


def test_json_has_no_free_whitespace_unless_asked(tiny):
    g = tiny.engine.grammars
    strict = g.matcher(StructuredOutputsParams(json=SCHEMA))
    assert not strict.accept_string('{ "label"')
    loose = g.matcher(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=False))
    assert loose.accept_string('{ \n  "label"')
    assert g.matcher(StructuredOutputsParams(json_object=True)).accept_string('{"a":')


def test_a_grammar_after_free_text_applies_once_it_ends(tiny):
    """A reasoning model's thinking comes first, unconstrained, up to its end tag; then the grammar."""
    m = tiny.engine.grammars.matcher(StructuredOutputsParams(choice=["yes", "no"], after="</think>"))
    assert m.accept_string("Any <think> text {") and m.accept_string("</think>")
    assert not m.accept_string("maybe") and m.accept_string("yes") and not m.accept_string("s")


def test_choices_beyond_the_basic_plane_match_themselves(tiny):
    m = tiny.engine.grammars.matcher(StructuredOutputsParams(choice=["🎉 party", "ok"]))
    assert m.accept_string("🎉 party")


def test_the_compiled_grammars_kept_are_bounded(tiny, monkeypatch):
    monkeypatch.setattr(grammar, "MAX_CACHED_GRAMMARS", 2)
    g = tiny.engine.grammars
    for n in range(4):
        g.compile(StructuredOutputsParams(regex=f"a{{{n + 1}}}"))
    assert len(g.cache) == 2 and ("regex", "a{4}", None, "spaced") in g.cache
    assert g._xgr_compiler().get_cache_size_bytes() == 0  # xgrammar's own cache, unbounded, holds none of them


def test_each_distinct_spec_compiles_once(tiny):
    g = tiny.engine.grammars
    before = len(g.cache)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    reordered = {"required": ["x"], "properties": {"x": {"type": "integer"}}, "type": "object"}
    tiny.generate(["a"] * 20 + ["b"] * 20, [constrained(StructuredOutputsParams(json=schema))] * 20
                  + [constrained(StructuredOutputsParams(json=reordered))] * 20, use_tqdm=False)
    assert len(g.cache) == before + 1


def test_schemas_that_differ_in_their_properties_order_keep_it(tiny):
    """The output's keys come in the schema's order, so two schemas that differ only there are two grammars."""
    props = {"m1": {"enum": ["a", "b"]}, "k1": {"type": "integer", "minimum": 0, "maximum": 9}}
    specs = [StructuredOutputsParams(json={"type": "object", "properties": dict(order), "required": ["m1", "k1"],
                                           "additionalProperties": False})
             for order in (props.items(), reversed(props.items()))]
    outs = tiny.generate(["a", "a"], [constrained(s) for s in specs], use_tqdm=False)
    assert [list(json.loads(o.outputs[0].text)) for o in outs] == [["m1", "k1"], ["k1", "m1"]]


def test_a_grammar_left_nothing_by_the_other_filters_ends_the_request(tiny):
    """allowed_token_ids with no token the grammar allows: no token leaves the grammar, the request ends
    ("abort"), the other rows run on."""
    spec = StructuredOutputsParams(choice=["yes", "no"])
    other = tiny.get_tokenizer().encode("zebra", add_special_tokens=False)[0]
    params = [constrained(spec, allowed_token_ids=[other], temperature=t, seed=1) for t in (0, 1)]
    outs = tiny.generate(["Is it?"] * 3, params + [constrained(spec)], use_tqdm=False)
    for o in outs[:2]:
        assert o.outputs[0].finish_reason == "abort" and o.outputs[0].text == ""
    assert outs[2].outputs[0].text in spec.choice and outs[2].outputs[0].finish_reason == "stop"


def test_a_grammar_that_can_only_end_ends_within_min_tokens(tiny):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    outs = tiny.generate(PROMPTS, [constrained(spec, min_tokens=5, temperature=t, seed=1) for t in (0, 1, 0, 1)],
                         use_tqdm=False)
    for o in outs:
        assert o.outputs[0].text in spec.choice and o.outputs[0].finish_reason == "stop"


def test_keywords_the_grammar_engine_would_not_enforce_are_refused(tiny):
    g = tiny.engine.grammars
    ok = {"type": "object", "properties": {"not": {"type": "integer", "multipleOf": 2}, "if": {"type": "string"}}}
    g.compile(StructuredOutputsParams(json=ok))  # properties named like keywords are names
    for schema, where in [({"type": "array", "uniqueItems": True}, "uniqueItems at #"),
                          ({"allOf": [{"type": "string"}, {"enum": ["a"]}]}, "allOf"),
                          ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a", "maxLength": 3}}},
                           "at #/properties/a"),
                          ({"type": "array", "items": {"type": "number", "multipleOf": 0.5}}, "at #/items"),
                          ({"$defs": {"d": {"not": {"type": "null"}}}}, "not at #/$defs/d")]:
        with pytest.raises(ValueError, match=f"structured_outputs.json was rejected.*{re.escape(where)}"):
            g.compile(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("spec,match", [
    (StructuredOutputsParams(json={"type": "strng"}), r"structured_outputs.json was rejected[^/]*$"),
    (StructuredOutputsParams(regex="a("), "structured_outputs.regex was rejected"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar was rejected"),
    (StructuredOutputsParams(regex="a", choice=["b"]), "exactly one of"),
])
def test_bad_specs_are_named_errors_and_nothing_runs(tiny, spec, match):
    with pytest.raises(ValueError, match=match):
        tiny.generate(["ok", "bad"], [SamplingParams(max_tokens=2), constrained(spec)], use_tqdm=False)
    assert not tiny.engine.has_unfinished()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_bitmask_equals_xgrammar(dtype):
    import xgrammar as xgr

    if fused_ops.unavailable(dtype, torch.device("cpu")):
        pytest.skip("no fused kernels here")
    vocab = 1000  # not a multiple of 32
    logits = torch.randn(6, vocab).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[0] = -1
    bitmask[1] = 0
    rows = [4, 0, 2]
    expected = logits.clone()
    full = torch.full((6, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=vocab)
    got = logits.clone()
    fused_ops.apply_bitmask(got, bitmask, torch.tensor(rows))
    assert torch.equal(got, expected)
