"""Sampler: greedy, temperature, top-k, top-p, and per-request seeded generators."""

import pytest
import torch

from flock.sample.sampler import Sampler
from flock.sampling_params import SamplingParams

# a small hand-made distribution: probabilities 0.4, 0.3, 0.2, 0.1 (logits in a shuffled order)
PROBS = torch.tensor([0.2, 0.4, 0.1, 0.3], dtype=torch.float64)
LOGITS = PROBS.log().float()
RANKED = [1, 3, 0, 2]  # token ids from most to least likely


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draw(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS, seed: int = 0) -> torch.Tensor:
    """n independent draws: n rows of the same logits, unseeded, from a sampler seeded with `seed`."""
    sampler = Sampler(seed)
    return sampler(logits.expand(n, -1).clone(), [params] * n, [None] * n)


def freqs(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(7, 50)
    params = [SamplingParams(temperature=0.0)] * 7
    out = Sampler(0)(logits, params, [None] * 7)
    assert out.dtype == torch.long and out.shape == (7,)
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_ignores_generators_and_top_k_top_p():
    torch.manual_seed(1)
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3)] * 3
    out = Sampler(0)(logits, params, [gen(3), gen(4), None])
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_rows_unaffected_by_sampled_rows_in_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(6, 30)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.5) for i in range(6)]
    out = Sampler(0)(logits, params, [None] * 6)
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))
    assert ((out >= 0) & (out < 30)).all()


def test_bfloat16_logits_are_accepted():
    logits = torch.randn(2, 16).bfloat16()
    out = Sampler(0)(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)], [None, None])
    assert out[0] == logits.float()[0].argmax()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_k_1_is_greedy(temperature):
    torch.manual_seed(3)
    logits = torch.randn(16, 40)
    params = [SamplingParams(temperature=temperature, top_k=1)] * 16
    out = Sampler(0)(logits, params, [gen(i) for i in range(16)])
    assert torch.equal(out, logits.argmax(-1))


def test_a_tiny_temperature_is_raised_to_vllms_floor(caplog):
    """As vLLM: 0 < temperature < 0.01 runs at 0.01 (the logits divided by less overflow), with a warning."""
    with caplog.at_level("WARNING", logger="flock.sampling_params"):
        assert SamplingParams(temperature=1e-4).temperature == 0.01
    assert "raised to 0.01" in caplog.text
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.02).temperature == 0.02


def test_tiny_top_p_keeps_only_the_top_token():
    torch.manual_seed(4)
    logits = torch.randn(16, 40)
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 16
    out = Sampler(0)(logits, params, [gen(i) for i in range(16)])
    assert torch.equal(out, logits.argmax(-1))


def test_temperature_frequencies_match_softmax():
    n = 10_000
    for t in (0.5, 1.0, 2.0):
        got = freqs(draw(SamplingParams(temperature=t), n, seed=11), 4)
        want = (LOGITS.double() / t).softmax(-1)
        assert (got - want).abs().max() < 0.02, (t, got, want)


def test_top_k_never_samples_outside_the_top_k():
    n = 10_000
    got = freqs(draw(SamplingParams(temperature=1.0, top_k=2), n, seed=12), 4)
    assert got[RANKED[2]] == 0 and got[RANKED[3]] == 0
    # the kept tokens are renormalised: 0.4 / 0.7 and 0.3 / 0.7
    assert abs(got[RANKED[0]] - 4 / 7) < 0.02 and abs(got[RANKED[1]] - 3 / 7) < 0.02


def test_top_k_with_a_large_vocab_and_high_temperature():
    torch.manual_seed(5)
    logits = torch.randn(1, 200)
    top = set(logits[0].topk(5).indices.tolist())
    out = draw(SamplingParams(temperature=5.0, top_k=5), 5000, logits=logits, seed=13)
    seen = set(out.tolist())
    assert seen <= top
    assert len(seen) == 5  # a flat (hot) distribution over the five reaches all of them


def test_top_p_keeps_the_smallest_set_reaching_p():
    n = 10_000
    # cumulative mass before each ranked token: 0, 0.4, 0.7, 0.9 -> top_p=0.6 keeps the first two
    got = freqs(draw(SamplingParams(temperature=1.0, top_p=0.6), n, seed=14), 4)
    assert got[RANKED[2]] == 0 and got[RANKED[3]] == 0
    assert abs(got[RANKED[0]] - 4 / 7) < 0.02
    # top_p=0.8 keeps three: 0.4, 0.3, 0.2 renormalised
    got = freqs(draw(SamplingParams(temperature=1.0, top_p=0.8), n, seed=15), 4)
    assert got[RANKED[3]] == 0
    assert abs(got[RANKED[0]] - 4 / 9) < 0.02 and abs(got[RANKED[2]] - 2 / 9) < 0.02


def test_top_p_applies_after_temperature():
    n = 10_000
    t = 0.5  # sharpened: 16, 9, 4, 1 over 30 -> mass before the 2nd token is 0.533
    got = freqs(draw(SamplingParams(temperature=t, top_p=0.5), n, seed=16), 4)
    assert set(torch.nonzero(got).flatten().tolist()) == {RANKED[0]}
    got = freqs(draw(SamplingParams(temperature=t, top_p=0.6), n, seed=16), 4)
    assert set(torch.nonzero(got).flatten().tolist()) == {RANKED[0], RANKED[1]}
    assert abs(got[RANKED[0]] - 16 / 25) < 0.02


def test_min_p_drops_tokens_below_its_share_of_the_top_after_temperature():
    n = 10_000
    # 0.4, 0.3, 0.2, 0.1: min_p=0.5 keeps p >= 0.2, three tokens renormalised
    got = freqs(draw(SamplingParams(temperature=1.0, min_p=0.5), n, seed=18), 4)
    assert got[RANKED[3]] == 0 and abs(got[RANKED[0]] - 4 / 9) < 0.02 and got[RANKED[2]] > 0
    # sharpened (16, 9, 4, 1 over 30) first: 0.5 of 16/30 drops the two least likely
    got = freqs(draw(SamplingParams(temperature=0.5, min_p=0.5), n, seed=19), 4)
    assert set(torch.nonzero(got).flatten().tolist()) == {RANKED[0], RANKED[1]}
    assert set(draw(SamplingParams(temperature=1.0, min_p=1.0), 1000, seed=20).tolist()) == {RANKED[0]}


def test_temperature_last_truncates_the_untempered_distribution():
    """llama.cpp's chain: top-p and min-p on 0.4, 0.3, 0.2, 0.1, then temperature 0.5 over what is left; a batch
    mixes both orders row by row."""
    n = 10_000
    late = SamplingParams(temperature=0.5, top_p=0.5, temperature_last=True)  # keeps two, then 16:9
    early = SamplingParams(temperature=0.5, top_p=0.5)  # sharpened first: keeps one
    sampler = Sampler(21)
    out = sampler(LOGITS.expand(2 * n, -1).clone(), [late, early] * n, [None] * (2 * n))
    got, first = freqs(out[0::2], 4), freqs(out[1::2], 4)
    assert set(torch.nonzero(got).flatten().tolist()) == {RANKED[0], RANKED[1]}
    assert abs(got[RANKED[0]] - 16 / 25) < 0.02 and set(torch.nonzero(first).flatten().tolist()) == {RANKED[0]}
    got = freqs(draw(SamplingParams(temperature=0.5, min_p=0.5, temperature_last=True), n, seed=22), 4)
    assert got[RANKED[3]] == 0 and abs(got[RANKED[0]] - 16 / 29) < 0.02 and abs(got[RANKED[2]] - 4 / 29) < 0.02


def test_llama_cpp_truncations():
    """On 0.4, 0.3, 0.2, 0.1: typical-p 0.5 keeps the three whose surprise is nearest the entropy (0.3, 0.2, then 0.4,
    whose mass passes 0.5); top-n-sigma 1 the logits within one standard deviation of the top (0.4, 0.3); XTC
    (threshold 0.25, always) drops 0.4, the likelier of the two above the threshold; never, it drops nothing."""
    n = 10_000

    def kept(params: SamplingParams, seed: int) -> set[int]:
        return set(torch.nonzero(freqs(draw(params, n, seed=seed), 4)).flatten().tolist())

    assert kept(SamplingParams(temperature=1.0, typical_p=0.5), 23) == {RANKED[0], RANKED[1], RANKED[2]}
    assert kept(SamplingParams(temperature=1.0, top_n_sigma=1.0), 24) == {RANKED[0], RANKED[1]}
    got = freqs(draw(SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.25), n, seed=25), 4)
    assert got[RANKED[0]] == 0 and abs(got[RANKED[1]] - 0.5) < 0.02 and abs(got[RANKED[3]] - 1 / 6) < 0.02
    assert kept(SamplingParams(temperature=1.0, xtc_probability=1e-9, xtc_threshold=0.25), 26) == set(RANKED)
    # in llama.cpp's chain: top-n-sigma leaves 4/7, 3/7, whose first alone passes typical-p's 0.5
    late = SamplingParams(temperature=0.5, typical_p=0.5, top_n_sigma=1.0, temperature_last=True)
    assert kept(late, 27) == {RANKED[0]}
    for bad in (dict(typical_p=0.0), dict(xtc_probability=1.5), dict(top_n_sigma=float("inf"))):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate()


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # top_k=2 leaves 4/7, 3/7; top_p=0.5 then keeps only the first (on the raw distribution it would keep two)
    out = draw(SamplingParams(temperature=1.0, top_k=2, top_p=0.5), 5000, seed=17)
    assert set(out.tolist()) == {RANKED[0]}


def test_mixed_top_k_top_p_rows_in_one_batch():
    """Each row's own top-k / top-p applies, whatever the other rows ask for."""
    n = 4000
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.0)] * n
    rows = len(params)
    out = Sampler(18)(LOGITS.expand(rows, -1).clone(), params, [None] * rows).view(n, 4)
    assert set(out[:, 0].tolist()) == {RANKED[0]}
    assert set(out[:, 1].tolist()) == {0, 1, 2, 3}  # no filter on this row
    assert set(out[:, 2].tolist()) == {RANKED[0], RANKED[1]}
    assert set(out[:, 3].tolist()) == {RANKED[0]}


def test_top_k_larger_than_vocab_alone_means_no_filter():
    out = draw(SamplingParams(temperature=1.0, top_k=100), 4000, seed=19)
    assert set(out.tolist()) == {0, 1, 2, 3}


def test_top_k_larger_than_vocab_next_to_a_filtered_row():
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_k=100)]
    out = Sampler(0)(LOGITS.expand(2, -1).clone(), params, [gen(0), gen(1)])
    assert out[0] in RANKED[:2] and 0 <= out[1] < 4


def test_draws_follow_a_large_vocab_across_chunk_boundaries():
    """The draw looks up chunk sums, then one chunk: mass on both sides of chunk edges and in the last,
    partial chunk (1,000 is not a multiple of the chunk size) is drawn in proportion, nothing else."""
    probs = torch.zeros(1000, dtype=torch.float64)
    probs[[0, 255, 256, 511, 999]] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=torch.float64)
    got = freqs(draw(SamplingParams(temperature=1.0), 10_000, logits=probs.log().float()[None], seed=23), 1000)
    assert (got - probs).abs().max() < 0.02


def test_masked_tokens_are_never_drawn_with_extreme_logits():
    logits = torch.tensor([[30.0, -30.0, 29.0, -1e4]])
    out = draw(SamplingParams(temperature=1.0, top_k=2), 4000, logits=logits, seed=20)
    assert set(out.tolist()) <= {0, 2}
    out = draw(SamplingParams(temperature=1.0, top_p=0.5), 4000, logits=logits, seed=21)
    assert set(out.tolist()) == {0}


# --------------------------------------------------------------------------- seeded generators


def run_seeded(steps: int, batches) -> list[int]:
    """Draw `steps` tokens for the seeded request (seed 1234) inside a changing batch; return its tokens.

    `batches(step)` gives (list of (params, generator or None), index of our row).
    """
    ours = gen(1234)
    sampler = Sampler(0)
    tokens = []
    torch.manual_seed(99)
    for step in range(steps):
        others, pos = batches(step)
        params = [p for p, _ in others]
        gens = [g for _, g in others]
        params.insert(pos, SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234))
        gens.insert(pos, ours)
        logits = torch.randn(len(params), 64)
        logits[pos] = torch.linspace(-2, 2, 64).roll(step)  # our row's logits do not depend on the batch
        out = sampler(logits, params, gens)
        tokens.append(int(out[pos]))
    return tokens


def test_same_seed_same_tokens_whatever_the_batch():
    alone = run_seeded(20, lambda step: ([], 0))
    assert len(set(alone)) > 5  # really random

    def crowded(step):
        others = [(SamplingParams(temperature=1.0), None), (SamplingParams(temperature=0.0), None),
                  (SamplingParams(temperature=1.3, seed=7), gen(7 + step)),
                  (SamplingParams(temperature=0.5, top_k=3), None)][: step % 5]
        return others, (step * 3) % (len(others) + 1)

    assert run_seeded(20, crowded) == alone

    def big(step):
        return [(SamplingParams(temperature=2.0, top_p=0.3), None)] * 9, 8 - step % 9

    assert run_seeded(20, big) == alone


def test_unseeded_rows_follow_the_sampler_seed_and_seeded_rows_their_own():
    logits = torch.zeros(20, 1000)
    p = [SamplingParams(temperature=1.0)] * 20

    def unseeded(sampler_seed):
        return Sampler(sampler_seed)(logits, p, [None] * 20).tolist()

    def seeded(sampler_seed, seeds):
        return Sampler(sampler_seed)(logits, p, [gen(s) for s in seeds]).tolist()

    assert unseeded(5) == unseeded(5)
    assert unseeded(5) != unseeded(6)
    seeds = list(range(100, 120))
    assert seeded(5, seeds) == seeded(6, seeds)  # the sampler's own seed does not matter for seeded rows
    assert seeded(5, seeds) != seeded(5, [s + 1000 for s in seeds])
    assert len(set(seeded(0, [7] * 20))) == 1  # twenty fresh generators with one seed agree


def test_two_requests_with_the_same_seed_draw_the_same_tokens():
    logits = torch.linspace(0, 3, 50).expand(2, -1).clone()
    params = [SamplingParams(temperature=1.0, seed=5)] * 2
    g1, g2 = gen(5), gen(5)
    sampler = Sampler(0)
    for _ in range(20):
        out = sampler(logits, params, [g1, g2])
        assert out[0] == out[1]


def test_tiny_temperature_is_nearly_greedy():
    logits = torch.tensor([[10.0, 9.0, -5.0, 0.0]])
    out = draw(SamplingParams(temperature=0.01), 2000, logits=logits, seed=22)
    assert set(out.tolist()) == {0}


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_p=0.7),
                                    SamplingParams(temperature=1.0, top_k=50),
                                    SamplingParams(temperature=0.6, top_k=50, top_p=0.5),
                                    SamplingParams(temperature=1.4, top_p=0.97)])
def test_top_k_top_p_rows_draw_their_full_distribution(params):
    """The fused top-k / top-p draw gives each token the probability `distribution` gives it (a grid of uniforms: the
    frequencies equal the probabilities to one grid step), wide nuclei included."""
    from flock.sample.sampler import _nucleus_draw, distribution

    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(5)) * 2
    n = 4000
    expected = distribution(logits, [params])[0].double()
    tokens = _nucleus_draw(logits.expand(n, -1).contiguous(), [params] * n,
                           (torch.arange(n, dtype=torch.float64) + 0.5) / n)
    assert bool((tokens >= 0).all())
    assert torch.allclose(freqs(tokens, 1000), expected, atol=1.5 / n)


def test_top_k_top_p_rows_the_fused_draw_cannot_draw_go_to_the_full_path():
    from flock.sample.sampler import _nucleus_draw

    logits = torch.randn(3, 100)
    logits[0, 5] = float("nan")
    logits[1] = float("-inf")
    logits[2, :] = 0.0  # every token tied at the top-k boundary
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 2 + [SamplingParams(temperature=1.0, top_k=3)]
    assert _nucleus_draw(logits, params, torch.full((3,), 0.5, dtype=torch.float64)).tolist() == [-1, -1, -1]
    tokens = Sampler(0)(logits[2:].expand(400, -1).clone(), params[2:] * 400, [None] * 400)
    assert len(set(tokens.tolist())) > 50  # the full path keeps every tied token

