"""Logprobs come from the same logits as sampling: output and prompt logprobs equal transformers' log-softmax in
float64, under every scheduler, chunk size and cache state (a prompt asking for them never reads the prefix
cache), and the greedy token is always rank 1."""

from dataclasses import replace

import pytest
import torch

from flock import LLM, SamplingParams
from flock.sample.logprobs import token_logprobs

from tests.engine.test_parity import shared_prefix_prompts

SCHEDULERS = ["fcfs", "lpm", "batchllm", "feather"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: ranks by the fused count
def test_token_logprobs_against_a_reference(dtype):
    logits = torch.randn(5, 300, dtype=dtype)
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie at the top
    chosen = torch.tensor([0, 299, 17, 9, 250])
    got = token_logprobs(torch.log_softmax(logits, -1), chosen, [0, 1, 3, 2, 20])
    ref = torch.log_softmax(logits, -1)
    for i, e in enumerate(got):
        assert e.token_id == chosen[i]
        assert e.logprob == pytest.approx(ref[i, chosen[i]].item(), abs=1e-12)
        assert e.rank == 1 + int((ref[i] > ref[i, chosen[i]]).sum())
        order = ref[i].argsort(descending=True, stable=True)
        assert [t for t, _ in e.top] == order[: [0, 1, 3, 2, 20][i]].tolist() or i == 3
        assert all(lp == pytest.approx(ref[i, t].item(), abs=1e-12) for t, lp in e.top)
    assert got[3].rank == 1 and {t for t, _ in got[3].top} == {7, 9}


@pytest.fixture(scope="module")
def reference(hf_folders):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folders["llama"], dtype=torch.float64).eval()

    def log_probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)

    return log_probs


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("chunk", [5, 2048])
def test_prompt_and_output_logprobs_equal_transformers(hf_folders, reference, scheduler, chunk):
    prompts = shared_prefix_prompts(seed=4)
    llm = LLM(str(hf_folders["llama"]), dtype="float64", block_size=4, scheduler=scheduler,
              max_num_batched_tokens=chunk)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)  # warm cache
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [params, plain] * (len(prompts) // 2)
                        + [params] * (len(prompts) % 2), use_tqdm=False)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        o = out.outputs[0]
        if i % 2:
            assert o.logprobs is None and out.prompt_logprobs is None
            continue
        ref = reference(p + o.token_ids)
        assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        for pos, e in enumerate(out.prompt_logprobs[1:], 1):
            assert e.token_id == p[pos] and e.logprob == pytest.approx(ref[pos - 1, p[pos]].item(), abs=1e-9)
            assert e.rank == 1 + int((ref[pos - 1] > ref[pos - 1, p[pos]]).sum())
            assert [t for t, _ in e.top] == ref[pos - 1].topk(2).indices.tolist()
        assert len(o.logprobs) == len(o.token_ids)
        for k, (t, e) in enumerate(zip(o.token_ids, o.logprobs)):
            row = ref[len(p) - 1 + k]
            assert e.token_id == t and e.rank == 1 and e.top[0][0] == t  # greedy: the most likely token
            assert e.logprob == pytest.approx(row[t].item(), abs=1e-9)
            assert [lp for _, lp in e.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-9)


def test_logprobs_are_raw_before_penalties_and_temperature(hf_folders):
    """As vLLM's default: a row's logprobs do not change with its penalties, bias or temperature."""
    llm = LLM(str(hf_folders["llama"]), dtype="float64", block_size=4)
    prompt = {"prompt_token_ids": shared_prefix_prompts(seed=5)[0]}
    base = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    biased = SamplingParams(temperature=0.7, seed=3, max_tokens=1, logprobs=5, presence_penalty=1.5,
                            repetition_penalty=1.3, logit_bias={11: 100.0})
    a, b = (llm.generate(prompt, p, use_tqdm=False)[0].outputs[0] for p in (base, biased))
    assert b.token_ids == [11]  # the bias picked the token, its logprob is the model's own
    assert [t for t, _ in a.logprobs[0].top] == [t for t, _ in b.logprobs[0].top]
    assert [lp for _, lp in a.logprobs[0].top] == pytest.approx([lp for _, lp in b.logprobs[0].top])
    assert b.logprobs[0].logprob == pytest.approx(dict((t, lp) for t, lp in a.logprobs[0].top).get(11, b.logprobs[0].logprob))
    assert b.logprobs[0].rank >= 1


def test_logprobs_modes_and_the_whole_vocabulary(hf_folders, reference):
    """vLLM's logprobs_mode: the model's logits (raw_logits), or the log-softmax / logits of what the token is drawn
    from after penalties, temperature and truncations (processed_*); logprobs -1 is every token, which
    max_logprobs -1 allows (the default, 20, refuses it by name)."""
    prompt = shared_prefix_prompts(seed=5)[0]
    ref = reference(prompt)[-1]  # log-softmax of the last row: the logits up to a constant
    params = SamplingParams(temperature=0.5, top_k=3, seed=3, max_tokens=1, logprobs=-1, presence_penalty=0.0)
    with pytest.raises(ValueError, match="logprobs -1 is more than the engine's max_logprobs 20"):
        LLM(str(hf_folders["llama"]), dtype="float64").generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    got = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
        llm = LLM(str(hf_folders["llama"]), dtype="float64", max_logprobs=-1, logprobs_mode=mode)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        entry = out.logprobs[0]
        assert len(entry) == len(ref) and entry[out.token_ids[0]].rank >= 1
        got[mode] = torch.tensor([entry[t].logprob for t in range(len(ref))], dtype=torch.float64)
    assert torch.allclose(got["raw_logprobs"], ref, atol=1e-9)
    assert torch.allclose(got["raw_logits"] - got["raw_logits"].logsumexp(-1), ref, atol=1e-9)
    top3 = ref.topk(3).indices
    kept = torch.full_like(ref, float("-inf"))
    kept[top3] = ref[top3] / 0.5
    assert torch.equal(torch.isfinite(got["processed_logits"]), torch.isfinite(kept))
    assert torch.allclose(got["processed_logprobs"][top3], kept.log_softmax(-1)[top3], atol=1e-9)
    shift = got["processed_logits"][top3] - kept[top3]  # logits, not logprobs: a constant apart
    assert torch.allclose(shift, shift[0].expand(3), atol=1e-9)
    # a request's own logprobs_mode, beside others in one batch, gives what the engine's mode gives
    modes = ["processed_logprobs", "raw_logprobs", "raw_logits", None]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 4, [replace(params, logprobs_mode=m) for m in modes],
                        use_tqdm=False)
    for mode, out in zip(modes, outs):
        entry = out.outputs[0].logprobs[0]
        mine = torch.tensor([entry[t].logprob for t in range(len(ref))], dtype=torch.float64)
        assert torch.allclose(mine, got[mode or "processed_logits"], atol=1e-6, equal_nan=True), mode


def test_prompt_logprobs_survive_preemption(hf_folders, reference):
    prompts = shared_prefix_prompts(seed=6)
    llm = LLM(str(hf_folders["llama"]), dtype="float64", block_size=4, num_kv_blocks=16, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.stats()["preemptions"] > 0
    for p, out in zip(prompts, outs):
        ref = reference(p)
        got = [e.logprob for e in out.prompt_logprobs[1:]]
        assert got == pytest.approx([ref[i, p[i + 1]].item() for i in range(len(p) - 1)], abs=1e-9)
