"""LoRA adapters: greedy tokens equal PEFT's over transformers for every adapter in one mixed batch, under every
scheduler; prefix-cache blocks are shared only within an adapter; bad adapters are refused by name."""

import json
import shutil
from dataclasses import replace

import pytest
import torch

from flock import LLM, LoRARequest, SamplingParams
from flock.model import gemm
from tests.engine.test_parity import assert_no_leak, shared_prefix_prompts
from tests.lora.adapters import ALL_FUSED, ALL_LLAMA, gguf_adapter, make_adapter, peft_greedy

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(hf_folders, tmp_path_factory):
    """Per model kind: two adapters (every projection; q and v only, rsLoRA, an alpha pattern) and the prompts
    with PEFT's tokens for each adapter and for none."""
    cache = {}

    def get(kind):
        if kind not in cache:
            root, base = tmp_path_factory.mktemp(f"lora-{kind}"), hf_folders[kind]
            every = ALL_FUSED if kind == "phi3" else ALL_LLAMA
            qv = ["qkv_proj"] if kind == "phi3" else ["q_proj", "v_proj"]
            a = make_adapter(base, root / "a", 1, every)
            b = make_adapter(base, root / "b", 2, qv, r=4, alpha=8, use_rslora=True,
                             alpha_pattern={"layers.1.self_attn.v_proj": 4})
            prompts = shared_prefix_prompts(seed=3)[:6]
            cache[kind] = a, b, prompts, {name: peft_greedy(base, adapter, prompts, MAX_NEW)
                                          for name, adapter in (("a", a), ("b", b), (None, None))}
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", ["llama", "qwen2", "phi3", "gemma", "qwen3"])
@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm"])
def test_adapters_match_peft_in_one_batch(hf_folders, adapters, kind, scheduler):
    a, b, prompts, expected = adapters(kind)
    assert expected["a"] != expected[None] and expected["b"] != expected[None]  # the adapters change the answers
    llm = LLM(str(hf_folders[kind]), dtype="float64", enable_lora=True, scheduler=scheduler, block_size=8)
    loras = [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b)), None]
    # every prompt with each adapter and with none, interleaved: the same tokens share no KV across adapters
    runs = [(lora, p) for p in prompts for lora in loras]
    outs = llm.generate([{"prompt_token_ids": p} for _, p in runs], GREEDY, use_tqdm=False,
                        lora_request=[lora for lora, _ in runs])
    got = {None if lora is None else lora.lora_name: [] for lora in loras}
    for (lora, _), out in zip(runs, outs):
        got[None if lora is None else lora.lora_name].append(out.outputs[0].token_ids)
    assert got == expected
    assert_no_leak(llm)


@pytest.mark.parametrize("ops", ["auto", "torch"])
def test_float32_speed_paths_match_peft(hf_folders, adapters, ops):
    """float32: the fused elementwise kernels and oneDNN's prepacked weights ("auto"), the activation then after
    the gate_up GEMM."""
    a, _, prompts, expected = adapters("llama")
    llm = LLM(str(hf_folders["llama"]), dtype="float32", enable_lora=True, ops=ops)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=LoRARequest("a", 1, str(a)))
    assert [o.outputs[0].token_ids for o in outs] == expected["a"]


@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm", "feather", "lpm"])
def test_prefix_blocks_are_shared_within_an_adapter_only(hf_folders, adapters, scheduler):
    a, b, _, _ = adapters("llama")
    llm = LLM(str(hf_folders["llama"]), dtype="float32", enable_lora=True, scheduler=scheduler, block_size=8)
    doc = list(range(100, 164))
    lora_a, lora_b = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    first = llm.generate({"prompt_token_ids": doc + [0]}, GREEDY, use_tqdm=False, lora_request=lora_a)[0]
    later = llm.generate([{"prompt_token_ids": doc + [i]} for i in (1, 2, 3)], GREEDY, use_tqdm=False,
                         lora_request=[lora_a, lora_b, None])
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in later] == [len(doc), 0, 0]


def test_the_activation_runs_after_the_gate_up_gemm(hf_folders):
    llm = LLM(str(hf_folders["llama"]), dtype="float32", enable_lora=True)
    assert not any(layer.mlp.gate_up_proj.silu_and_mul for layer in llm.engine.runner.model.layers)


def test_lora_modules_load_at_start(hf_folders, adapters):
    a, b, prompts, expected = adapters("llama")
    llm = LLM(str(hf_folders["llama"]), dtype="float64", lora_modules=[f"a={a}", json.dumps({"name": "b", "path": str(b)})])
    assert sorted(llm.engine.lora_requests) == ["a", "b"] and llm.config.enable_lora
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=llm.engine.lora_requests["b"])
    assert [o.outputs[0].token_ids for o in outs] == expected["b"]


@pytest.mark.parametrize("spec, match", [(["a"], "NAME=PATH"), (["=x"], "NAME=PATH"), (['{"name": "a"}'], "NAME=PATH"),
                                         (["{bad"], "not JSON"), (["a=x", "a=y"], "twice")])
def test_bad_lora_modules_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        LLM("flock/tiny", lora_modules=spec)


def test_bad_adapters_are_refused_by_name(hf_folders, adapters, tmp_path, monkeypatch):
    base = hf_folders["llama"]
    a, _, _, _ = adapters("llama")
    prompt = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(base), dtype="float32").generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(a)))
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=4)
    cases = [
        (LoRARequest("a", 1, str(a)), "rank 8, more than max_lora_rank=4"),
        (LoRARequest("none", 1, str(tmp_path / "missing")), "adapter_config.json"),
        (LoRARequest("", 1, str(a)), "lora_name"),
        (LoRARequest("embed", 1, str(make_adapter(base, tmp_path / "embed", 0, ["embed_tokens", "q_proj"], r=2))),
         "not a LoRA A or B weight"),
        (LoRARequest("dora", 1, str(make_adapter(base, tmp_path / "dora", 0, ["q_proj"], r=2, use_dora=True))),
         "use_dora"),
        (LoRARequest("other", 1, str(make_adapter(hf_folders["qwen3"], tmp_path / "other", 0, ["q_proj"], r=2))),
         "another model"),
    ]
    for i, (request, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match) as e:
            llm.generate([prompt, prompt], GREEDY, use_tqdm=False, lora_request=[None, request])
        assert "request 1" in str(e.value), i
    ok = make_adapter(base, tmp_path / "small", 0, ["q_proj"], r=2)
    for key, value, match in [("init_lora_weights", "pissa", "PiSSA"), ("alora_invocation_tokens", [5, 6], "alora"),
                              ("layer_replication", [[0, 2]], "layer_replication")]:
        changed = shutil.copytree(ok, tmp_path / key)
        config = json.loads((changed / "adapter_config.json").read_text())
        (changed / "adapter_config.json").write_text(json.dumps(config | {key: value}))
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest(key, 1, str(changed)))
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("small", 1, str(ok)))
    monkeypatch.setenv("HOME", str(ok.parent))  # a path from the home folder, as vLLM expands it
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("home", 1, f"~/{ok.name}"))
    assert_no_leak(llm)


def test_alpha_patterns_are_regexes_matched_as_peft_matches_them():
    """PEFT's rule: a key (a regex) matches the end of a module's name after a dot; an alternation is one key."""
    from peft.utils.other import get_pattern_key

    from flock.lora.adapter import _scale

    patterns = {"q_proj|v_proj": 64, "layers.1.k_proj": 32}
    config = {"lora_alpha": 16, "alpha_pattern": patterns}
    for module in ("model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.q_proj",
                   "model.layers.1.self_attn.k_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.up_proj"):
        alpha = patterns.get(get_pattern_key(list(patterns), module), 16)
        assert _scale(config, module, 8) == alpha / 8, module


@pytest.mark.parametrize("dtype, quantization", [("bfloat16", "none"), ("bfloat16", "q8_0"), ("float32", "q8_0")])
def test_steps_with_adapters_run_in_the_step_program(hf_folders, adapters, dtype, quantization):
    """Decode steps run as one C call (the step program), with the LoRA updates of their adapters recorded after
    each projection (bf16: csrc/gemm_lora.h; float32 steps with adapters run the modules): the same tokens as a
    run without the program, and the adapter's differ from the base model's. Both runs compute every prompt
    token: a second run's prefix-cache hits would attend in other pieces, whose bf16 sums round differently."""
    a, _, prompts, _ = adapters("llama")
    llm = LLM(str(hf_folders["llama"]), dtype=dtype, quantization=quantization, enable_lora=True,
              enable_prefix_caching=False)
    model = llm.engine.runner.model
    if model.step_program is None:
        pytest.skip(f"no step program here: {llm.engine.runner.paths.get('step')}")
    loras = [LoRARequest("a", 1, str(a)), None] * len(prompts)
    batch = [{"prompt_token_ids": p} for p in prompts for _ in range(2)]

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)]

    with_program = tokens()
    model.step_program = None
    assert tokens() == with_program
    assert with_program[0::2] != with_program[1::2]


@pytest.mark.parametrize("path", sorted({gemm.isa(), *gemm.emulated_paths()} - {None}))
@pytest.mark.parametrize("masked", [False, True])
def test_the_c_update_equals_float_products_rounded_as_bf16(path, masked):
    """y += mask(x A^T) B^T (gemm.add_lora): x A^T rounded to bf16, y plus its product rounded once; rows whose
    adapter does not own a rank column get nothing from it."""
    gen = torch.Generator().manual_seed(0)
    m, k, n, ranks = 7, 64, 80, 32
    x, a, b, y = (torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in ((m, k), (ranks, k), (n, ranks), (m, n)))
    owners = torch.tensor([1] * 12 + [2] * 16 + [-1] * 4, dtype=torch.int32)
    rows = torch.tensor([1, 2, 0, 2, 1, 1, 0]) if masked else None
    got = y.clone()
    gemm.add_lora(got, x, gemm.pack(a), ranks, gemm.pack(b), rows, owners, path=path)
    shrunk = (x.double() @ a.double().T).to(torch.bfloat16)
    if masked:
        shrunk = shrunk * (rows[:, None] == owners[None, :])
    expected = (y.double() + shrunk.double() @ b.double().T).to(torch.bfloat16)
    # fp32 sums against float64 ones: a rounding may differ by one bf16 step
    assert torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
    assert not torch.equal(got, y)


def held(lora) -> set[int]:
    """The adapter ids whose weights the model holds."""
    return {i for target in lora.targets.values() for i in target.lora.updates}


def test_an_adapter_unloaded_while_its_requests_run_finishes_them_then_lets_go(hf_folders, adapters):
    """As vLLM's unload: it succeeds while requests run; those admitted keep its weights to their end, then the
    weights go; a request admitted later still carrying it runs on a copy read for it alone."""
    a, _, prompts, expected = adapters("llama")
    llm = LLM(str(hf_folders["llama"]), dtype="float64", enable_lora=True)
    engine, lora = llm.engine, LoRARequest("a", 1, str(a))
    running = engine.add_request(prompts[0], replace(GREEDY, lora_request=lora))
    engine.step()
    engine.unload_lora("a")
    with pytest.raises(ValueError, match="no LoRA adapter"):
        engine.unload_lora("a")
    late = engine.add_request(prompts[1], replace(GREEDY, lora_request=lora))
    assert late.adapter_id != running.adapter_id and held(engine.runner.lora) == {running.adapter_id, late.adapter_id}
    while engine.has_unfinished():
        engine.step()
    assert [running.output_token_ids, late.output_token_ids] == expected["a"][:2]
    assert held(engine.runner.lora) == set() and not engine.runner.lora.loaded and not engine.runner.lora.users
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY, use_tqdm=False, lora_request=lora)
    assert [o.outputs[0].token_ids for o in outs] == expected["a"][:2]  # one copy for both, gone with them
    assert held(engine.runner.lora) == set() and not engine.runner.lora.copies
    engine.load_lora(lora)
    assert len(engine.runner.lora.loaded) == len(held(engine.runner.lora)) == 1


@pytest.mark.parametrize("inplace", [False, True])
def test_a_name_loaded_again_reads_none_of_its_old_weights_kv(hf_folders, adapters, inplace):
    """The prefix cache keys an adapter by its load: the name's new weights (another folder, or its folder
    rewritten and read in place) compute the prompt again; the old blocks gave a's answer under b's weights."""
    a, b, prompts, expected = adapters("llama")
    llm = LLM(str(hf_folders["llama"]), dtype="float64", enable_lora=True, block_size=4)
    prompt = {"prompt_token_ids": prompts[0]}
    first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(a)))[0]
    assert first.outputs[0].token_ids == expected["a"][0]
    if inplace:
        llm.engine.load_lora(LoRARequest("x", 1, str(b)), inplace=True)
        assert list(llm.engine.runner.lora.loaded) == [("x", str(b))]
    else:
        llm.engine.unload_lora("x")
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(b)))[0]
    assert again.outputs[0].token_ids == expected["b"][0] and again.num_cached_tokens == 0
    assert len(held(llm.engine.runner.lora)) == 1


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_llama_cpp_gguf_adapters_match_peft(hf_folders, adapters, kind, tmp_path):
    """A GGUF adapter as llama.cpp's converter writes it (Llama's q and k rows in its order) gives PEFT's tokens, on
    the Hugging Face folder and on the model as a GGUF file."""
    from tests.model.gguf_files import write_gguf

    a, _, prompts, expected = adapters(kind)
    config = json.loads((hf_folders[kind] / "config.json").read_text())
    adapter = gguf_adapter(a, tmp_path / "a.gguf", "llama" if kind == "llama" else kind, config["num_attention_heads"],
                           config["num_key_value_heads"])
    for model in (hf_folders[kind], write_gguf(hf_folders[kind], tmp_path / "model.gguf")):
        llm = LLM(str(model), dtype="float64", enable_lora=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                            lora_request=LoRARequest("a", 1, str(adapter)))
        assert [o.outputs[0].token_ids for o in outs] == expected["a"]
    with pytest.raises(ValueError, match="not of this"):
        LLM(str(hf_folders["qwen3"]), dtype="float32", enable_lora=True).generate(
            [1, 2], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
