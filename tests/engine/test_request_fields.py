"""vLLM's request fields that change how an output is delivered, not what is generated: `detokenize`,
`skip_reading_prefix_cache` and `stream_interval`."""

import asyncio

import pytest

from flock import LLM, SamplingParams
from flock.config import EngineConfig
from flock.engine.async_engine import AsyncEngine

PROMPT = list(range(30, 70))


@pytest.fixture(scope="module")
def llm():
    return LLM("flock/tiny", num_kv_blocks=64, block_size=8)


def test_detokenize_false_gives_token_ids_alone(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text, ids = (llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
                 for p in (params, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False)))
    assert ids.text == "" and text.text and ids.token_ids == text.token_ids
    with pytest.raises(ValueError, match="detokenize"):
        llm.generate([PROMPT], SamplingParams(stop=["x"], detokenize=False), use_tqdm=False)


def test_skip_reading_prefix_cache_computes_the_prompt_and_still_fills_the_cache(llm):
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    skip = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, skip_reading_prefix_cache=True)
    first, cached, skipped = (llm.generate([PROMPT], p, use_tqdm=False)[0] for p in (skip, params, skip))
    assert first.num_cached_tokens == skipped.num_cached_tokens == 0
    assert cached.num_cached_tokens == len(PROMPT) - 1  # the blocks the skipping request wrote
    assert first.outputs[0].token_ids == cached.outputs[0].token_ids == skipped.outputs[0].token_ids
    with pytest.raises(ValueError, match="skip_reading_prefix_cache"):
        llm.generate([PROMPT], SamplingParams(skip_reading_prefix_cache="yes"), use_tqdm=False)


@pytest.mark.parametrize("engine_interval, request_interval, sizes", [
    (1, None, [1] * 8), (1, 3, [1, 3, 3, 1]), (2, None, [1, 2, 2, 2, 1]), (4, 3, [1, 4, 3])])
def test_stream_interval_groups_a_streams_tokens(engine_interval, request_interval, sizes):
    """The first token at once, then every interval (the larger of the server's and the request's), the rest
    with the finish."""
    engine = AsyncEngine(EngineConfig.from_kwargs("flock/tiny", num_kv_blocks=64), stream_interval=engine_interval)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stream_interval=request_interval)

    async def go():
        return [out async for out in engine.add_request(PROMPT, params)]

    try:
        engine.start()
        outs = asyncio.run(go())
    finally:
        engine.shutdown()
    assert [len(o.token_ids) for o in outs] == sizes and outs[-1].finished
    assert "".join(o.text for o in outs)


def test_a_finished_request_reports_its_phases_and_preemptions():
    """vLLM's per-request metrics: queued until first scheduled, prefill until the first token, decode until the
    last; a request that lost its KV counts its preemptions."""
    engine = LLM("flock/tiny", num_kv_blocks=6, block_size=4, max_num_batched_tokens=64,
                 enable_prefix_caching=False).engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reqs = [engine.add_request(list(range(30 + i, 36 + i)), params) for i in range(3)]
    assert all(r.times() is None for r in reqs)  # not scheduled yet
    while engine.has_unfinished():
        engine.step()
    times = [r.times() for r in reqs]
    assert all(t.queued >= 0 and 0 <= t.prefill <= t.prefill + t.decode for t in times)
    assert any(t.decode > 0 for t in times)
    assert [t.num_preemptions for t in times] == [r.num_preemptions for r in reqs] and sum(
        t.num_preemptions for t in times) > 0
