"""vLLM's cache_salt: a salted request's KV blocks are shared only with requests of the same salt, from the prefix
cache under every scheduler and through BatchLLM's groups with prefix caching off; a salt changes no output."""

import pytest

from flock import LLM, SamplingParams

DOC = list(range(100, 164))  # 8 blocks of 8
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def prompt(i: int, salt: str | None = None) -> dict:
    return {"prompt_token_ids": DOC + [i]} | ({"cache_salt": salt} if salt else {})


@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm", "feather", "lpm"])
def test_a_salted_prefix_is_found_by_its_salt_only(scheduler):
    llm = LLM("flock/tiny", scheduler=scheduler, block_size=8, dtype="float32")
    first = llm.generate(prompt(0, "tenant-a"), GREEDY, use_tqdm=False)[0]
    later = llm.generate([prompt(1, "tenant-a"), prompt(2, "tenant-b"), prompt(3)], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in later] == [len(DOC), 0, 0]
    again = llm.generate([prompt(4), prompt(5, "tenant-b")], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [len(DOC), len(DOC)]
    unsalted = LLM("flock/tiny", scheduler=scheduler, block_size=8, dtype="float32", enable_prefix_caching=False)
    plain = unsalted.generate([{"prompt_token_ids": DOC + [i]} for i in range(6)], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == \
        [o.outputs[0].token_ids for o in [first, *later, *again]]


def test_batchllm_groups_never_span_salts():
    """Without the prefix cache BatchLLM shares a group's prefix blocks itself: one group per salt."""
    llm = LLM("flock/tiny", scheduler="batchllm", block_size=8, dtype="float32", enable_prefix_caching=False)
    salts = [None, None, "a", "a", "a", "b"]
    outs = llm.generate([prompt(i, s) for i, s in enumerate(salts)], GREEDY, use_tqdm=False)
    assert llm.stats()["computed_prefill_tokens"] == 3 * len(DOC) + len(salts)
    plain = LLM("flock/tiny", scheduler="batchllm", block_size=8, dtype="float32", enable_prefix_caching=False)
    same = plain.generate([prompt(i) for i in range(6)], GREEDY, use_tqdm=False)
    assert plain.stats()["computed_prefill_tokens"] == len(DOC) + len(salts)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in same]


def test_a_bad_salt_is_refused():
    llm = LLM("flock/tiny", num_kv_blocks=64)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [1, 2], "cache_salt": ""}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [1, 2], "cache_salt": 7}, GREEDY, use_tqdm=False)
