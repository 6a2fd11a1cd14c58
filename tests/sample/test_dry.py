"""llama.cpp's DRY penalty and dynamic temperature: the penalties against a brute-force reading of the rule, the
breakers read from a real tokenizer, and what the engine and llama-server's API do with them."""

import math
import random

import pytest
import torch

from flock import LLM, SamplingParams
from flock.sample.dry import breaker_tokens, dry_penalties
from flock.sample.sampler import _dynamic_temperatures


def as_dict(result) -> dict[int, float]:
    ids, penalties = result
    return dict(zip(ids.tolist(), penalties.tolist()))


def brute_force(ctx: list[int], multiplier: float, base: float, allowed: int, breakers: set[int]) -> dict[int, float]:
    """For each token t: the longest L such that the context's last L tokens followed by t occur in the context,
    L reaching back no further than the last breaker; penalized when L >= allowed, breakers never."""
    n = len(ctx)
    limit = next((back for back in range(n) if ctx[n - 1 - back] in breakers), n)
    if n <= allowed or limit < allowed:
        return {}
    out = {}
    for t in set(ctx) - breakers:
        for length in range(min(limit, n - 1), allowed - 1, -1):
            pattern = ctx[n - length :] + [t]
            if any(ctx[i : i + length + 1] == pattern for i in range(n - length)):
                out[t] = multiplier * base ** (length - allowed)
                break
    return out


def test_llama_cpp_example():
    # "a b c c b c y a b c": emitting c would make "a b c c" (3 repeated before it), y "b c y" (2), b "c b" (1)
    assert as_dict(dry_penalties([1, 2, 3, 3, 2, 3, 4, 1, 2, 3], 1.0, 2.0, 2, {})) == {3: 2.0, 4: 1.0}


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_rule_on_random_contexts(seed):
    rng = random.Random(seed)
    ctx = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
    allowed, breakers = rng.randrange(0, 4), {3} if seed % 2 else set()
    got = as_dict(dry_penalties(ctx, 0.8, 1.75, allowed, {b: ((),) for b in breakers}))
    want = brute_force(ctx, 0.8, 1.75, allowed, breakers)
    assert got.keys() == want.keys() and all(math.isclose(got[t], want[t]) for t in want)


def test_penalty_exponent_is_capped():
    ids, penalties = dry_penalties([5] * 500, 1.0, 1.75, 2, {})
    assert ids.tolist() == [5] and math.isfinite(penalties[0]) and penalties[0] > 1e30


@pytest.fixture(scope="module")
def llm():
    return LLM("flock/tiny", dtype="float32")


def test_breakers_read_from_the_vocabulary(llm):
    tok = llm.get_tokenizer()
    heads = breaker_tokens(tok, ("\n", "<|im_end|>x"))
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1 and () in heads[newline[0]]
    # a multi-token breaker: its first token, then the rest's tokens
    parts = tok.encode("<|im_end|>x", add_special_tokens=False)
    assert len(parts) > 1 and tuple(parts[1:]) in heads[parts[0]]
    # a repetition reaches back only to just after a breaker, its tail included; the head alone breaks nothing
    assert as_dict(dry_penalties([9, 10, *parts, 11, 12, 9, 10, *parts, 11], 1.0, 2.0, 2, heads)) == {}
    assert as_dict(dry_penalties([9, 10, parts[0], 11, 12, 9, 10, parts[0], 11], 1.0, 2.0, 2, heads)) == {12: 4.0}


def test_engine_applies_dry(llm):
    prompt = [5, 6, 7, 8, 9] * 6 + [5, 6]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    dry = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, dry_multiplier=5.0,
                                                dry_penalty_last_n=-1))
    assert plain[0].outputs[0].token_ids != dry[0].outputs[0].token_ids
    assert dry[0].outputs[0].token_ids[0] != 7  # "... 9 5 6" went on to 7, six times over


def test_dry_with_drafts_reads_them(llm):
    """Speculative rows after drafts see them in the context DRY scans: greedy outputs equal those without."""
    prompt = [5, 6, 7, 8, 9] * 4 + [11, 12, 13, 5, 6]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, dry_multiplier=0.5, dry_allowed_length=3)
    spec = LLM("flock/tiny", dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    assert spec.generate([prompt], params)[0].outputs[0].token_ids == llm.generate([prompt], params)[0].outputs[0].token_ids
    assert spec.stats()["draft_tokens"] > 0


def test_dynamic_temperature():
    flat, peaked, single = torch.zeros(1, 8), torch.tensor([[9.0] + [-9.0] * 7]), torch.tensor([[0.0] + [-math.inf] * 7])
    params = [SamplingParams(temperature=1.0, dynatemp_range=0.5)]
    assert _dynamic_temperatures(flat, params).item() == pytest.approx(1.5)  # most uncertain: the top
    assert _dynamic_temperatures(peaked, params).item() == pytest.approx(0.5, abs=1e-3)  # certain: the bottom
    assert _dynamic_temperatures(single, params).item() == 1.0  # one token left: unscaled
    half = torch.log(torch.tensor([[0.5, 0.5, 0.0, 0.0]]))  # entropy log 2 over two finite logits: 1
    assert _dynamic_temperatures(half, [SamplingParams(temperature=1.0, dynatemp_range=0.5,
                                                       dynatemp_exponent=2.0)]).item() == pytest.approx(1.5)
    out = LLM("flock/tiny").generate(["a b"], SamplingParams(temperature=0.8, dynatemp_range=0.5, seed=3, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("field, value", [("dry_multiplier", -1.0), ("dry_base", 0.5), ("dry_allowed_length", -1),
                                          ("dry_penalty_last_n", -2), ("dry_sequence_breakers", []),
                                          ("dynatemp_range", -0.1), ("dynatemp_exponent", math.inf)])
def test_bad_values_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def reference_mirostat(logits: list[float], version: int, tau: float, eta: float, mu: float, u: float, m: int = 100):
    """llama.cpp's two Mirostat samplers written out plainly, on a list of logits after the temperature."""
    z = max(logits)
    p = [math.exp(x - z) for x in logits]
    total = sum(p)
    ranked = sorted(((q / total, t) for t, q in enumerate(p)), key=lambda e: -e[0])
    if version == 2:
        keep = max(1, sum(1 for q, _ in ranked if -math.log2(q) <= mu))
    else:
        pairs = [(math.log((i + 2) / (i + 1)), math.log(ranked[i][0] / ranked[i + 1][0]))
                 for i in range(min(m - 1, len(ranked) - 1))]
        s = sum(a * b for a, b in pairs) / sum(a * a for a, _ in pairs)
        keep = max(int(((s - 1) * 2**mu / (1 - len(logits) ** -(s - 1))) ** (1 / s)), 1)
    kept = ranked[:keep]
    mass = sum(q for q, _ in kept)
    acc = 0.0
    for q, t in kept:
        acc += q / mass
        if u < acc:
            return t, mu - eta * (-math.log2(q / mass) - tau)
    q, t = kept[-1]
    return t, mu - eta * (-math.log2(q / mass) - tau)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_mirostat_draw_and_update(version, seed):
    from flock.sample.sampler import _mirostat

    rng = random.Random(seed)
    logits = [rng.gauss(0, 3) for _ in range(300)]
    mu, u = rng.uniform(1, 12), rng.random()
    p = SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=rng.uniform(1, 6), mirostat_eta=0.1)
    token, new_mu = _mirostat(torch.tensor(logits, dtype=torch.float64), p, mu, u)
    want_token, want_mu = reference_mirostat(logits, version, p.mirostat_tau, p.mirostat_eta, mu, u)
    assert token == want_token and new_mu == pytest.approx(want_mu, rel=1e-6)


def test_mirostat_in_the_engine(llm):
    greedy = llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for version in (1, 2):
        # tau 0 keeps only the most likely token at every step: greedy (version 2: mu stays 0)
        params = SamplingParams(temperature=0.8, mirostat=version, mirostat_tau=0.0, max_tokens=10, ignore_eos=True,
                                seed=1)
        if version == 2:
            assert llm.generate(["a b c"], params)[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
        # the bound moves with each token, and a seeded request draws the same in any batch
        params = SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=3.0, max_tokens=10, ignore_eos=True,
                                seed=7)
        engine = llm.engine
        req = engine.add_request(llm.get_tokenizer().encode("a b c"), params)
        while engine.has_unfinished():
            engine.step()
        assert req.mirostat_mu != 6.0
        alone = llm.generate(["a b c"], params)[0].outputs[0].token_ids
        batch = llm.generate(["x y", "a b c"], params)[1].outputs[0].token_ids
        assert req.output_token_ids == alone == batch
