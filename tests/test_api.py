"""The offline API: vLLM-like inputs and outputs, bad input rejected up front, nothing lost or leaked."""

import pytest
from tqdm import tqdm

from flock import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("flock/tiny", block_size=8, max_model_len=128)


def assert_clean(llm: LLM) -> None:
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_blocks and not any(pool.ref_count)
    assert not llm.engine.has_unfinished()


def test_string_and_token_prompts_in_input_order(llm):
    tok = llm.get_tokenizer()
    prompts = ["The cache is paged.", {"prompt_token_ids": tok.encode("def f(x):")}, "Hello"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == ["The cache is paged.", None, "Hello"]
    assert outs[1].prompt_token_ids == tok.encode("def f(x):")
    for o in outs:
        assert len(o.outputs[0].token_ids) == 5 and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    single = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert_clean(llm)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ({"prompt_token_ids": []}, SamplingParams(), "prompt is empty"),
        ("", SamplingParams(), "prompt is empty"),
        ({"prompt_token_ids": [5] * 129}, SamplingParams(), "max_model_len"),
        ({"prompt_token_ids": [1, 2, 99999]}, SamplingParams(), r"prompt_token_ids\[2\]"),
        ({"prompt_token_ids": [1, -1]}, SamplingParams(), "outside the vocabulary"),
        ("ok", SamplingParams(max_tokens=0), "max_tokens"),
        ("ok", SamplingParams(max_tokens=-3), "max_tokens"),
        ("ok", SamplingParams(top_p=0.0), "top_p"),
        ("ok", SamplingParams(top_p=1.5), "top_p"),
        ("ok", SamplingParams(temperature=-1), "temperature"),
        ("ok", SamplingParams(seed=2**63), "seed"),
        ("ok", SamplingParams(temperature=float("nan")), "temperature"),
        ("ok", SamplingParams(min_p=-0.1), "min_p"),
        ({"text": "no prompt field"}, SamplingParams(), "'prompt' or 'prompt_token_ids'"),
        ("ok", SamplingParams(stop_token_ids=["a"]), "stop_token_ids"),
        ("ok", SamplingParams(stop_token_ids=[-5]), "stop_token_ids"),
        ("ok", SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
    ],
)
def test_bad_request_is_named_before_any_work(llm, prompt, params, message):
    good = SamplingParams(temperature=0, max_tokens=3)
    added = llm.engine._next_id
    with pytest.raises(ValueError, match=message) as err:
        llm.generate(["fine", prompt, "also fine"], [good, params, good], use_tqdm=False)
    assert "request 1" in str(err.value)
    assert llm.engine._next_id == added  # no request was queued
    assert_clean(llm)
    outs = llm.generate(["fine", "also fine"], good, use_tqdm=False)  # the engine is unharmed
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert_clean(llm)


def test_a_prompt_of_another_type_is_named(llm):
    with pytest.raises(TypeError, match="not int"):
        llm.generate(123, use_tqdm=False)


def test_sampling_params_clone_as_vllm():
    params = SamplingParams(stop=["x"], logit_bias={5: 1.0})
    copied = params.clone()
    copied.stop.append("y")
    assert copied == SamplingParams(stop=["x", "y"], logit_bias={5: 1.0}) and params.stop == ["x"]


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM("flock/tiny", max_num_seq=4)


def test_stop_token_ids_and_strings(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                          stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=True)  # as vLLM: the stop token is not
    kept = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                           stop_token_ids=[stop_id], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == tok.decode(out.token_ids, skip_special_tokens=True)
    stop_str = base.text[len(base.text) // 2 :][:3]
    cut = base.text.index(stop_str)
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop_str],
                                include_stop_str_in_output=include)
        out = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop_str
        assert out.text == base.text[: cut + len(stop_str) * include]
        # the same stop string completed by the last token max_tokens allows still stops the output
        params.max_tokens = len(out.token_ids)
        last = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
        assert (last.finish_reason, last.text) == ("stop", out.text)
    assert_clean(llm)


def test_seed_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True)
    alone = llm.generate("The cache", seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(["x y z", "The cache", "another prompt here"], [other, seeded, other], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different = llm.generate("The cache", SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=10,
                                                        ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert different != alone


def test_stats_keys(llm):
    llm.generate(["a b c d e f g h i j k", "a b c d e f g h i j k l"], SamplingParams(max_tokens=2), use_tqdm=False)
    s = llm.stats()
    for key in ("logical_prefill_tokens", "computed_prefill_tokens", "saving_rate", "steps", "mean_tokens_per_step",
                "schedule_seconds", "model_seconds", "peak_kv_blocks", "prompt_tokens_per_s",
                "generated_tokens_per_s", "total_tokens_per_s"):
        assert key in s
    assert s["num_requests"] == 2 and s["generated_tokens"] == 4
    assert 0 < s["saving_rate"] < 1  # the second prompt reuses the first one's full block


def test_chat_template_options_as_vllm(llm):
    partial = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
    greedy = SamplingParams(temperature=0, max_tokens=3)
    out = llm.chat(partial, greedy, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids).endswith("My answer is")
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(partial, greedy, use_tqdm=False, continue_final_message=True)


def test_n_samples_of_a_prompt_as_vllm(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate(["The cache", "x y"], params, use_tqdm=False)
    assert [[c.index for c in o.outputs] for o in outs] == [[0, 1, 2]] * 2
    for j, c in enumerate(outs[0].outputs):  # sample j is the request seeded seed + j
        alone = llm.generate("The cache", SamplingParams(temperature=1.0, seed=40 + j, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
        assert c.token_ids == alone.token_ids
        assert c.cumulative_logprob == pytest.approx(sum(e.logprob for e in c.logprobs))
    assert llm.generate("a", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].cumulative_logprob is None
    with pytest.raises(ValueError, match="n must be"):
        llm.generate("a", SamplingParams(n=0), use_tqdm=False)
    with pytest.raises(ValueError, match="one sample"):
        llm.engine.add_request([1, 2], SamplingParams(n=2))
    assert_clean(llm)


def test_vllm_engine_keywords_flock_already_runs_as():
    """vLLM's LLM keywords and defaults as a vLLM script spells them: accepted where nothing changes here, mapped
    where Flock has them under another name; a use_tqdm callable makes the bar."""
    import torch

    llm = LLM("flock/tiny", tensor_parallel_size=1, enforce_eager=False, trust_remote_code=True,
              disable_log_stats=False, gpu_memory_utilization=0.9, enable_chunked_prefill=False, tokenizer_mode="hf",
              quantization=None,
              enable_prefix_caching=None, dtype=torch.float32, scheduling_policy="priority",
              override_generation_config={"temperature": 0.5, "max_new_tokens": 7})
    assert (llm.engine.config.scheduler, llm.engine.config.enable_prefix_caching, llm.engine.runner.dtype) == \
        ("priority", True, torch.float32)
    assert llm.get_default_sampling_params().temperature == 0.5
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer()
    bars = []

    def bar(**kw):
        bars.append(kw)
        return tqdm(**kw, disable=True)

    assert llm.generate("a", use_tqdm=bar)[0].outputs[0].token_ids and bars[0]["total"] == 1
    assert len(llm.generate("a", use_tqdm=False)[0].outputs[0].token_ids) == 7
    assert llm.reset_prefix_cache(reset_running_requests=False)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported"):
        LLM("flock/tiny", tensor_parallel_size=2)
    for bad, match in [({"tokenizer_mode": "mistral"}, "tokenizer_mode"), ({"hf_overrides": lambda c: c}, "a dict")]:
        with pytest.raises(ValueError, match=match):
            LLM("flock/tiny", **bad)


def test_chat_reads_text_parts_and_takes_vllms_template_arguments(llm):
    """Text-only content parts join (vLLM's "string" content format) or reach the template as text parts
    ("openai"); chat_template and priority per call; the engine as `llm_engine`."""
    greedy = SamplingParams(temperature=0, max_tokens=3)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a"},
                                          {"type": "input_text", "text": "colour."}]}]
    joined = [{"role": "user", "content": "Name a\ncolour."}]
    assert llm.chat(parts, greedy, use_tqdm=False)[0].prompt_token_ids == \
        llm.chat(joined, greedy, use_tqdm=False)[0].prompt_token_ids
    from flock.tokenizer import bos_prefix

    special = llm.chat(joined, greedy, use_tqdm=False, tokenization_kwargs={"add_special_tokens": True})[0]
    assert special.prompt_token_ids == bos_prefix(llm.get_tokenizer()) + \
        llm.chat(joined, greedy, use_tqdm=False)[0].prompt_token_ids
    template = "{% for m in messages %}[{{ m['content'] if m['content'] is string else m['content'][1]['text'] }}]" \
               "{% endfor %}"
    for fmt, expected in (("string", "[Name a\ncolour.]"), ("openai", "[colour.]")):
        out = llm.chat(parts, greedy, use_tqdm=False, chat_template=template, chat_template_content_format=fmt)[0]
        assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(parts, greedy, use_tqdm=False, chat_template_content_format="xml")
    with pytest.raises(ValueError, match="priority must be 0 unless"):
        llm.chat(parts, greedy, use_tqdm=False, priority=2)
    with pytest.raises(ValueError, match="got 1 values of priority for 2 prompts"):
        llm.generate(["a", "b"], greedy, use_tqdm=False, priority=[0])
    assert llm.generate(["a", "b"], greedy, use_tqdm=False, priority=[0, 0])[1].outputs[0].finished()
    assert llm.llm_engine is llm.engine


def test_logprobs_read_as_vllms_dicts_of_logprob(llm):
    """vLLM code reads `logprobs[i][token_id].logprob` (`.rank`, `.decoded_token`): each entry is also a mapping
    of the chosen token and its alternatives; logprobs=True means 1, seed=-1 no seed (as vLLM's)."""
    out = llm.generate("The cache", SamplingParams(temperature=0, max_tokens=3, logprobs=True, prompt_logprobs=2),
                       use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    for entry, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids):
        assert list(entry)[0] == token and len(entry) in (1, 2) and entry[token].logprob == entry.logprob
        assert entry[token].rank == 1 and entry[token].decoded_token == tok.decode([token])
    first = out.prompt_logprobs[1]
    ranks = [lp.rank for t, lp in first.items() if t != first.token_id]
    assert ranks == [i + 1 for i, (t, _) in enumerate(first.top) if t != first.token_id]
    assert all(lp.decoded_token == tok.decode([t]) for t, lp in first.items())
    listed = llm.generate("The cache", SamplingParams(max_tokens=1, logprob_token_ids=[7, 3]), use_tqdm=False)[0]
    entry = listed.outputs[0].logprobs[0]
    assert [entry[t].rank for t in (7, 3) if t != entry.token_id] == [None] * len({7, 3} - {entry.token_id})
    assert SamplingParams(seed=-1).seed is None and SamplingParams(prompt_logprobs=True).prompt_logprobs == 1


def test_max_model_len_past_the_models_positions_is_refused_unless_allowed(monkeypatch):
    """As vLLM's (VLLM_ALLOW_LONG_MAX_MODEL_LEN): the model was never trained past its positions."""
    for value in (None, "0", "false"):  # read as vLLM reads its variable: only 1 or true allow it
        if value is not None:
            monkeypatch.setenv("FLOCK_ALLOW_LONG_MAX_MODEL_LEN", value)
        with pytest.raises(ValueError, match="max_model_len=8192 is longer than the model's 4096 positions"):
            LLM("flock/tiny", max_model_len=8192)
    monkeypatch.setenv("FLOCK_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert LLM("flock/tiny", max_model_len=8192, num_kv_blocks=600).engine.max_model_len == 8192


def test_vllms_other_fields_and_tokenization_kwargs(llm):
    """Code written for vLLM 0.32 runs: SamplingParams' fields that change no output here are accepted, those
    Flock does not run refused by name; outputs carry vLLM's fields; generate's tokenization_kwargs truncate."""
    from flock.outputs import RequestOutput

    params = SamplingParams(temperature=0, max_tokens=2, spaces_between_special_tokens=False, output_kind=2,
                            flat_logprobs=True, skip_clone=True, output_text_buffer_length=4,
                            extra_args={"custom": 1}, watermarking=False, routed_experts_prompt_start=0)
    out = llm.generate("The cache", params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == llm.generate("The cache", SamplingParams(temperature=0, max_tokens=2),
                                                    use_tqdm=False)[0].outputs[0].token_ids
    assert (out.lora_request, out.outputs[0].lora_request, out.encoder_prompt, out.metrics) == (None,) * 4
    assert isinstance(out, RequestOutput)
    for bad in ({"watermarking": True}, {"trace_decode_token_ids": [1]}, {"routed_experts_prompt_start": 3}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=.* is not supported"):
            llm.generate("a", SamplingParams(**bad), use_tqdm=False)
    ids = llm.get_tokenizer().encode("one two three four five six", add_special_tokens=True)
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False,
                       tokenization_kwargs={"truncate_prompt_tokens": 3, "truncation_side": "right"})[0]
    assert cut.prompt_token_ids == ids[:3]
    with pytest.raises(ValueError, match="tokenization_kwargs takes"):
        llm.generate("a", SamplingParams(max_tokens=1), use_tqdm=False, tokenization_kwargs={"padding": True})


def test_tokenization_kwargs_add_special_tokens(tmp_path):
    """vLLM's tokenization_kwargs={"add_special_tokens": False}: a rendered prompt gets no second BOS."""
    from tests.model.gguf_files import write_spm_gguf

    llm = LLM("flock/tiny", load_format="dummy", tokenizer=str(write_spm_gguf(tmp_path / "s.gguf")))
    tok = llm.get_tokenizer()
    with_bos = llm.generate("the cat", SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    bare = llm.generate("the cat", SamplingParams(max_tokens=1), use_tqdm=False,
                        tokenization_kwargs={"add_special_tokens": False})[0].prompt_token_ids
    assert with_bos == [tok.bos_token_id, *bare] and bare == tok.encode("the cat", add_special_tokens=False)
