import pytest

from flock.spec import NgramProposer, SpeculativeConfig, accepted


def proposer(k=3, lo=1, hi=3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(k, prompt_lookup_max=hi, prompt_lookup_min=lo))


def test_longest_suffix_wins_over_a_later_shorter_one():
    # suffix (1, 2, 3): its 3-gram occurs once, at the start; "3" alone occurs later, before 9
    assert proposer().lookup([1, 2, 3, 4, 5, 3, 9, 1, 2, 3], 10) == [4, 5, 3]


def test_last_occurrence_of_the_longest_match():
    assert proposer().lookup([7, 8, 1, 7, 8, 2, 7, 8], 10) == [2, 7, 8]


def test_drafts_stop_at_the_context_end_and_at_the_limits():
    assert proposer().lookup([5, 6, 5], 10) == [6, 5]
    assert proposer(k=4).lookup([1, 2, 3, 1, 2, 3, 1, 2, 3], 2) == [1, 2]
    assert proposer().lookup([1, 2, 1], 0) == []


def test_no_match_or_too_short():
    assert proposer().lookup([1, 2, 3, 4], 10) == []
    assert proposer(lo=2).lookup([1, 2, 3, 1, 4, 1], 10) == []
    assert proposer(lo=2).lookup([1, 2, 3, 1, 2], 10) == [3, 1, 2]
    assert proposer().lookup([1], 10) == []


def test_overlapping_repeats():
    assert proposer(k=4, hi=5).lookup([9, 9, 9, 9], 10) == [9]


@pytest.mark.parametrize("tokens, drafts, n", [([1, 2, 3, 4], [1, 2, 3], 3), ([1, 5, 3, 4], [1, 2, 3], 1),
                                               ([6, 2, 3], [1, 2], 0), ([4], [], 0)])
def test_accepted_counts_leading_matches(tokens, drafts, n):
    assert accepted(tokens, drafts) == n


def test_rows_after_drafts_count_them_as_output():
    """min_tokens and the frequency penalty of the row after a draft see the draft as generated."""
    import torch

    from flock.request import Request
    from flock.sample.sampler import Sampler
    from flock.sampling_params import SamplingParams
    from flock.spec import DraftRow

    eos, draft = 0, 5
    req = Request(0, [9, 9], SamplingParams(temperature=0, min_tokens=2, frequency_penalty=2.0))
    req.token_ids.append(7)  # one output token so far
    rows = [DraftRow(req, []), DraftRow(req, [draft])]
    logits = torch.zeros(2, 8)
    logits[:, eos], logits[:, draft], logits[:, 3] = 3.0, 2.5, 1.0
    tokens = Sampler(0, [eos], 8).sample(logits, rows).tokens.tolist()
    # row 0: EOS held back (1 output token < 2), the draft wins; row 1: EOS allowed (2 tokens, the draft counted)
    assert tokens == [draft, eos]
    logits[:, eos] = -9.0
    assert Sampler(0, [eos], 8).sample(logits, rows).tokens.tolist() == [draft, 3]  # the draft penalized after itself


def test_draft_count_follows_the_acceptance_rate():
    from flock.spec import drafts_worth, updated_rate

    assert drafts_worth(1.0, 4) == 4 and drafts_worth(0.76, 4) == 4 and drafts_worth(0.6, 4) == 2
    assert drafts_worth(0.45, 4) == 1 and drafts_worth(0.0, 4) == 1  # one at least, to keep measuring
    rate = 1.0
    for _ in range(6):  # every first draft refused: one failure a step
        rate = updated_rate(rate, 4, 0)
    assert rate < 0.2 and drafts_worth(rate, 4) == 1
    assert updated_rate(0.5, 4, 4) == pytest.approx(0.65) and updated_rate(0.5, 0, 0) == 0.5
    assert updated_rate(0.5, 3, 2) == pytest.approx(0.7 * 0.5 + 0.3 * 2 / 3)
