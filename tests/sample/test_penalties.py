"""Penalties, logit_bias and min_tokens with vLLM's semantics: against a per-row float64 reference, against
transformers' repetition penalty, and through the engine (EOS held back, tokens forced, plain rows untouched)."""

import random
from dataclasses import dataclass, field

import pytest
import torch

from flock import LLM, SamplingParams
from flock.model import save_model
from flock.sample.penalties import adjust, apply_penalties
from flock.sample.sampler import Sampler

VOCAB = 50
EOS = 1  # flock/tiny's </s>


@dataclass
class Tokens:
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    forced_token: int | None = None


def reference(row: torch.Tensor, p: SamplingParams, tokens: Tokens, eos: set[int]) -> torch.Tensor:
    """One row adjusted token by token in float64, in vLLM's order."""
    x = row.double().tolist()
    out = tokens.output_token_ids
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else float("-inf") for t, v in enumerate(x)]
    for ids in p.bad_words_token_ids or []:
        if len(ids) - 1 <= len(out) and out[len(out) - len(ids) + 1:] == ids[:-1]:
            x[ids[-1]] = float("-inf")
    if len(out) < p.min_tokens:
        for t in eos | set(p.stop_token_ids):
            x[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    window = None if p.penalty_last_n is None else (tokens.prompt_token_ids + out)[::-1][:p.penalty_last_n]
    for t in set(tokens.prompt_token_ids) | set(out) if window is None else set(window):
        r = p.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    counted = out if window is None else window  # llama.cpp's: the last n tokens of the prompt and output
    for t in set(counted):
        x[t] -= p.frequency_penalty * counted.count(t) + p.presence_penalty
    return torch.tensor(x, dtype=torch.float64)


def random_rows(n: int, seed: int) -> list[Tokens]:
    rng = random.Random(seed)
    return [Tokens([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))],
                   [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 20))]) for _ in range(n)]


KINDS = {
    "presence": lambda rng: SamplingParams(presence_penalty=rng.uniform(-2, 2)),
    "frequency": lambda rng: SamplingParams(frequency_penalty=rng.uniform(-2, 2)),
    "repetition": lambda rng: SamplingParams(repetition_penalty=rng.uniform(0.2, 3)),
    "logit_bias": lambda rng: SamplingParams(logit_bias={rng.randrange(VOCAB): rng.uniform(-10, 10) for _ in range(5)}),
    "min_tokens": lambda rng: SamplingParams(min_tokens=rng.randrange(0, 25), stop_token_ids=[rng.randrange(VOCAB)]),
    "allowed_token_ids": lambda rng: SamplingParams(allowed_token_ids=rng.sample(range(VOCAB), 5)),
    "bad_words": lambda rng: SamplingParams(bad_words_token_ids=[[rng.randrange(VOCAB)], [3, rng.randrange(VOCAB)]] + [
        [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 4))] for _ in range(3)]),
    "llama.cpp's window": lambda rng: SamplingParams(
        repetition_penalty=rng.uniform(0.2, 3), frequency_penalty=rng.uniform(-2, 2),
        presence_penalty=rng.uniform(-2, 2), penalty_last_n=rng.choice([0, 1, 5, 20, 64])),
    "all": lambda rng: SamplingParams(
        presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.uniform(0.2, 3), logit_bias={rng.randrange(VOCAB): rng.uniform(-10, 10)},
        min_tokens=rng.randrange(0, 25), stop_token_ids=[rng.randrange(VOCAB)],
        allowed_token_ids=[EOS, 7] + rng.sample(range(8, VOCAB), 10)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_adjustment_matches_a_per_row_reference(kind, dtype):
    rng = random.Random(len(kind))
    n = 12
    torch.manual_seed(len(kind))
    logits = torch.randn(n, VOCAB, dtype=dtype) * 3
    rows = random_rows(n, seed=len(kind))
    params = [KINDS[kind](rng) if i % 3 else SamplingParams() for i in range(n)]  # every third row plain
    eos = {EOS, 7}
    expected = torch.stack([reference(logits[i], params[i], rows[i], eos) for i in range(n)])
    got = apply_penalties(logits.clone(), params, rows, eos)
    assert got.dtype == dtype
    tol = dict(rtol=0, atol=0) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got.double(), expected, **tol)
    assert torch.equal(got[::3], logits[::3])  # plain rows keep their logits exactly


def test_a_batch_that_asks_for_nothing_keeps_its_logits_tensor():
    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(min_tokens=2), SamplingParams()]
    rows = [Tokens([3]), Tokens([4]), Tokens([5], [6, 7]), Tokens([8])]  # min_tokens already reached
    assert apply_penalties(logits, params, rows, {EOS}) is logits


def test_bfloat16_logits_are_widened_to_float32():
    logits = torch.randn(2, VOCAB).bfloat16()
    params = [SamplingParams(), SamplingParams(logit_bias={3: 0.001})]
    got = apply_penalties(logits, params, random_rows(2, seed=1))
    assert got.dtype == torch.float32
    assert got[1, 3] == logits[1, 3].float() + torch.tensor(0.001)


def test_penalties_do_not_change_the_other_rows_picks():
    """Greedy and seeded sampled rows pick what they pick alone when penalised rows share their step."""
    torch.manual_seed(3)
    logits = torch.randn(6, VOCAB)
    plain = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=5, top_k=10)]
    penalised = [SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={9: 5.0}),
                 SamplingParams(temperature=1.0, seed=7, frequency_penalty=1.5, min_tokens=30)]
    rows = random_rows(6, seed=2)
    order = [0, 2, 1, 3, 2, 3]  # plain, penalised, plain, penalised, penalised, penalised
    params = [(plain + penalised)[k] for k in order]
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    mixed = Sampler(0)(logits.clone(), params, gens, rows)
    alone = Sampler(0)(logits[[0, 2]].clone(), plain, [None, torch.Generator().manual_seed(5)], [rows[0], rows[2]])
    assert mixed[[0, 2]].tolist() == alone.tolist()
    # and the penalised greedy row picks the argmax of its adjusted logits
    adjusted = adjust(logits[1:2].clone(), [params[1]], [rows[1]])
    assert mixed[1] == adjusted.argmax()


# through the engine


@pytest.fixture(scope="module")
def tiny():
    return LLM("flock/tiny", dtype="float64", max_num_batched_tokens=128)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300, 200, 100]]


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_repetition_penalty_matches_transformers(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(save_model("flock/tiny", tmp_path / "tiny", dtype="float32"),
                                               dtype=torch.float64).eval()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    got = [o.token_ids for o in run(tiny, PROMPTS, params)]
    plain = [o.token_ids for o in run(tiny, PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    assert got != plain  # the penalty changes these outputs
    for prompt, tokens in zip(PROMPTS, got):
        ids = torch.tensor([prompt])
        expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)
        assert tokens == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_back_eos_then_stops_at_it(tiny, temperature):
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=10, min_tokens=3, logit_bias={EOS: 100})
    for out in run(tiny, PROMPTS, params):
        assert len(out.token_ids) == 4 and EOS not in out.token_ids[:3] and out.token_ids[3] == EOS
        assert out.finish_reason == "stop"
    # without min_tokens the biased EOS comes first
    eos_first = SamplingParams(temperature=0, logit_bias={EOS: 100})
    assert [o.token_ids for o in run(tiny, PROMPTS, eos_first)] == [[EOS]] * 2


def test_min_tokens_holds_back_stop_token_ids(tiny):
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=2, stop_token_ids=[42], logit_bias={42: 100})
    for out in run(tiny, PROMPTS, params):
        assert len(out.token_ids) == 3 and out.token_ids[2] == 42 and 42 not in out.token_ids[:2]
        assert out.finish_reason == "stop" and out.stop_reason == 42


def test_no_stop_string_within_min_tokens(tiny):
    """As vLLM: a stop string is looked for only in the text that follows the first min_tokens tokens'."""
    decode = tiny.get_tokenizer().decode
    full = run(tiny, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop = decode(full.token_ids[:1]).strip()[:1]
    assert stop
    early = run(tiny, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop))[0]
    assert early.token_ids == full.token_ids[:1] and early.finish_reason == "stop"  # ends at once without
    held = run(tiny, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop,
                                                 min_tokens=3))[0]
    assert len(held.token_ids) > 3 and held.token_ids == full.token_ids[:len(held.token_ids)]
    start = len(decode(full.token_ids[:3])) - len(stop) + 1
    cut = full.text.find(stop, start)
    if cut < 0:
        assert held.text == full.text and held.finish_reason == "length"
    else:
        assert held.text == full.text[:cut] and held.stop_reason == stop


def test_logit_bias_forces_a_token(tiny):
    for params in (SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={42: 100}),
                   SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True, logit_bias={"42": 1e9})):
        assert [o.token_ids for o in run(tiny, PROMPTS, params)] == [[42] * 4] * 2


def test_allowed_token_ids_are_the_only_ones_sampled(tiny):
    for params in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[42, 77]),
                   SamplingParams(temperature=1.5, seed=3, max_tokens=6, ignore_eos=True, allowed_token_ids=[42, 77])):
        assert all(set(o.token_ids) <= {42, 77} for o in run(tiny, PROMPTS, params))


def test_bad_words_are_never_generated(tiny):
    """A word that greedy decoding would write first is not written with bad_words, with or without the space
    that begins it; the other rows are untouched."""
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    free = run(tiny, PROMPTS, SamplingParams(**greedy))
    tok = tiny.get_tokenizer()
    for prompt, out in zip(PROMPTS, free):
        word = tok.decode(out.token_ids[:1])
        banned = run(tiny, [prompt], SamplingParams(bad_words=[word], **greedy))[0].token_ids
        assert banned[0] != out.token_ids[0] and word.strip() not in tok.decode(banned[:1])
    params = SamplingParams(bad_words=["x"], **greedy)
    params.tokenize_bad_words(tok)
    assert params.bad_words_token_ids[0] == tok.encode("x", add_special_tokens=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny):
    """As vLLM: the last k tokens (the first with truncation_side right); -1 keeps max_model_len - 1."""
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    long = list(range(5, 105))
    out = tiny.generate([{"prompt_token_ids": long}], SamplingParams(truncate_prompt_tokens=8, **greedy))[0]
    assert out.prompt_token_ids == long[-8:] and out.outputs[0].token_ids == run(tiny, [long[-8:]],
                                                                                 SamplingParams(**greedy))[0].token_ids
    right = SamplingParams(truncate_prompt_tokens=8, truncation_side="right", **greedy)
    assert tiny.generate([{"prompt_token_ids": long}], right)[0].prompt_token_ids == long[:8]
    limit = tiny.engine.max_model_len
    too_long = list(range(5, 5 + limit + 10))
    out = tiny.generate([{"prompt_token_ids": too_long}], SamplingParams(truncate_prompt_tokens=-1, **greedy))[0]
    assert out.prompt_token_ids == too_long[-(limit - 1):]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        tiny.generate([{"prompt_token_ids": long}], SamplingParams(truncate_prompt_tokens=limit + 1, **greedy))


def test_a_penalised_request_leaves_a_plain_one_in_its_step_unchanged(tiny):
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    penalised = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.5,
                               presence_penalty=1.0, frequency_penalty=0.5, logit_bias={7012: 3.0})
    alone = run(tiny, PROMPTS[:1], plain)[0].token_ids
    together = run(tiny, PROMPTS, [plain, penalised])
    assert together[0].token_ids == alone
    assert together[1].token_ids == run(tiny, PROMPTS[1:], penalised)[0].token_ids


def test_logit_bias_keys_and_values_are_normalised():
    p = SamplingParams(logit_bias={"5": 250, 6: -1e9, 7: 1.5})
    assert p.logit_bias == {5: 100.0, 6: -100.0, 7: 1.5}


@pytest.mark.parametrize("kwargs, field_name", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty="1"), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logit_bias={"abc": 1.0}), "logit_bias"),
    (dict(logit_bias={5: "high"}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias=[5, 1.0]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids"),
    (dict(bad_words=[" "]), "bad_words"),
    (dict(bad_words="word"), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncation_side="middle"), "truncation_side"),
])
def test_validation_names_the_field(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        SamplingParams(**kwargs).validate()


def test_logit_bias_outside_the_vocabulary_is_refused(tiny):
    SamplingParams(logit_bias={8191: 1.0}).validate(vocab_size=8192)
    with pytest.raises(ValueError, match=r"logit_bias token ids \[8192\] are outside the vocabulary"):
        tiny.generate([{"prompt_token_ids": [5]}], SamplingParams(logit_bias={8192: 1.0}), use_tqdm=False)
    assert not tiny.engine.has_unfinished()
