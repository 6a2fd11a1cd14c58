"""Label logprobs and generative scoring: `logprob_token_ids` lists exactly the asked tokens' logprobs, from the
raw logits sampling draws from, and `LLM.generative_score` gives each item's label probabilities as transformers
does in float64, under every scheduler, whatever the items share."""

import math

import numpy as np
import pytest
import torch

from flock import LLM, SamplingParams
from flock.label_scores import LabelQuery
from flock.sample.logprobs import token_logprobs

from tests.engine.test_parity import shared_prefix_prompts
from tests.sample.test_logprobs import reference  # noqa: F401 (a fixture: transformers' log-softmax in float64)

LABELS = [17, 5, 4000, 17]  # a label may repeat; the order is the caller's


def test_listed_tokens_in_their_order():
    logprobs = torch.log_softmax(torch.randn(3, 50, dtype=torch.float64), -1)
    got = token_logprobs(logprobs, torch.tensor([3, 4, 5]), [2, 0, 1], [None, [9, 1, 9], [0]])
    assert [t for t, _ in got[0].top] == logprobs[0].topk(2).indices.tolist()
    assert got[1].top == [(9, logprobs[1, 9].item()), (1, logprobs[1, 1].item()), (9, logprobs[1, 9].item())]
    assert got[2].top == [(0, logprobs[2, 0].item())]


@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm", "feather"])
def test_logprob_token_ids_equal_transformers(hf_folders, reference, scheduler):
    """Rows asking for listed tokens, top alternatives, both (the list wins, as vLLM's) or nothing, in one batch;
    sampled and greedy."""
    llm = LLM(str(hf_folders["llama"]), dtype="float64", block_size=4, scheduler=scheduler)
    prompts = shared_prefix_prompts(seed=6)[:4]
    base = dict(max_tokens=3, ignore_eos=True)
    params = [SamplingParams(temperature=0, logprob_token_ids=LABELS, **base),
              SamplingParams(temperature=0.8, seed=2, logprobs=2, logprob_token_ids=LABELS[:2], **base),
              SamplingParams(temperature=0, logprobs=2, **base), SamplingParams(temperature=0, **base)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, sp, out in zip(prompts, params, outs):
        o = out.outputs[0]
        if not sp.wants_logprobs:
            assert o.logprobs is None
            continue
        ref = reference(p + o.token_ids)
        for k, (t, e) in enumerate(zip(o.token_ids, o.logprobs)):
            row = ref[len(p) - 1 + k]
            assert e.token_id == t and e.logprob == pytest.approx(row[t].item(), abs=1e-9)
            listed = sp.logprob_token_ids or row.topk(2).indices.tolist()
            assert [i for i, _ in e.top] == listed
            assert [lp for _, lp in e.top] == pytest.approx(row[listed].tolist(), abs=1e-9)


def test_logprob_token_ids_are_checked(hf_folders):
    llm = LLM(str(hf_folders["llama"]), dtype="float64", block_size=4)
    for bad in ([], [8192], [-1], [True], "5", list(range(129))):
        with pytest.raises(ValueError, match="logprob_token_ids"):
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(logprob_token_ids=bad), use_tqdm=False)


def _expected(reference, prompts: list[list[int]], labels: list[int], apply_softmax: bool) -> list[list[float]]:
    out = []
    for p in prompts:
        row = reference(p)[-1][labels]
        out.append((row.softmax(-1) if apply_softmax else row.exp()).tolist())
    return out


@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm", "feather"])
def test_generative_score_equals_transformers(hf_folders, reference, scheduler):
    llm = LLM(str(hf_folders["llama"]), dtype="float64", block_size=4, scheduler=scheduler)
    query = shared_prefix_prompts(seed=7)[0][:30]
    items = [[50 + i, 60 + i, 70 + i * 3][: 1 + i % 3] for i in range(7)]
    for apply_softmax in (False, True):
        for item_first in (False, True):
            got = llm.generative_score(query, items, LABELS[:3], apply_softmax, item_first, use_tqdm=False)
            prompts = [i + query if item_first else query + i for i in items]
            assert got == [pytest.approx(e, rel=1e-9, abs=1e-12)
                           for e in _expected(reference, prompts, LABELS[:3], apply_softmax)]


def test_generative_score_of_texts_joins_them_as_text(hf_folders, reference):
    """SGLang's way: the query and item texts joined, then tokenized (with the tokenizer's special tokens)."""
    llm = LLM(str(hf_folders["llama"]), dtype="float64", block_size=4)
    tokenizer = llm.engine.tokenizer
    query, items = "Is this city a capital? Answer:", [" Paris", " Lyon", " Rome"]
    got = llm.generative_score(query, items, [11, 12], apply_softmax=True, use_tqdm=False)
    prompts = [tokenizer.encode(query + item) for item in items]
    assert got == [pytest.approx(e, rel=1e-9) for e in _expected(reference, prompts, [11, 12], True)]
    assert all(sum(s) == pytest.approx(1.0) for s in got)


def test_generative_score_refuses_bad_requests_by_name(hf_folders):
    llm = LLM(str(hf_folders["llama"]), dtype="float64", block_size=4)
    for kwargs, field in [(dict(label_token_ids=[]), "label_token_ids"), (dict(label_token_ids=[9999]), "outside"),
                          (dict(items=[]), "items"), (dict(items=["a", [1]]), "items"),
                          (dict(query=[1, 2], items=["a"]), "query"), (dict(query=None), "query"),
                          (dict(apply_softmax=1), "apply_softmax")]:
        request = dict(query="q", items=["a"], label_token_ids=[1]) | kwargs
        with pytest.raises(ValueError, match=field):
            llm.generative_score(**request, use_tqdm=False)


def test_probabilities_over_labels():
    q = LabelQuery("q", ["a"], [1, 2, 3], apply_softmax=True)
    assert q.probabilities([(1, 0.0), (2, math.log(3)), (3, -math.inf)]) == pytest.approx([0.25, 0.75, 0.0])
    assert q.probabilities([(1, -math.inf)] * 3) == pytest.approx([1 / 3] * 3)  # all masked: no preference
    q.apply_softmax = False
    assert q.probabilities([(1, math.log(0.5)), (2, -math.inf)]) == pytest.approx([0.5, 0.0])


def test_prompt_logprob_token_ids_equal_transformers(hf_folders, reference):
    """vLLM's prompt_logprob_token_ids: each prompt row from prompt_logprob_start scores its own ids (padding -1:
    -inf) as predictions of the next prompt token; the prompt never reads the prefix cache for it."""
    llm = LLM(str(hf_folders["llama"]), dtype="float64", block_size=4, max_num_batched_tokens=8)
    prompt, start = [(13 * i + 5) % 8000 for i in range(21)], 6
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)  # cached now
    rows = [[(37 * i) % 8192, -1, 100 + i][: 1 + i % 3] for i in range(len(prompt) - 1 - start)]
    params = SamplingParams(max_tokens=1, prompt_logprob_token_ids=rows, prompt_logprob_start=start)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    ref = reference(prompt)
    got = out.prompt_token_id_logprobs
    assert got.shape == (len(rows), 3) and out.prompt_logprobs is None and out.num_cached_tokens == 0
    for i, row in enumerate(rows):
        want = [ref[start + i, t].item() if t >= 0 else -math.inf for t in row] + [-math.inf] * (3 - len(row))
        assert got[i].tolist() == pytest.approx(want, rel=1e-6)
    padded = np.array([row + [-1] * (3 - len(row)) for row in rows])  # vLLM's type: an array of [rows, ids]
    as_array = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=1, prompt_logprob_token_ids=padded, prompt_logprob_start=start), use_tqdm=False)[0]
    np.testing.assert_array_equal(as_array.prompt_token_id_logprobs, got)
    for bad, why in [(dict(prompt_logprob_token_ids=rows[1:], prompt_logprob_start=start), "rows"),
                     (dict(prompt_logprob_token_ids=rows, prompt_logprob_start=start, prompt_logprobs=1), "both"),
                     (dict(prompt_logprob_start=2), "needs prompt_logprob_token_ids"),
                     (dict(prompt_logprob_token_ids=[[8192]] * 20), "vocabulary")]:
        with pytest.raises(ValueError, match=why):
            llm.generate({"prompt_token_ids": prompt}, SamplingParams(**bad), use_tqdm=False)
