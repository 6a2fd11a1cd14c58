"""The central invariant: scheduling never changes results. Greedy tokens equal transformers `generate`."""

import json
import random

import pytest
import torch

from flock import LLM, SamplingParams
from flock.engine.runner import StepOutput
from flock.sample.logprobs import log_softmax

MAX_NEW = 8


def shared_prefix_prompts(seed: int, vocab: int = 8192) -> list[list[int]]:
    """Mixed lengths; groups sharing prefixes (some block-aligned, some not); a duplicate prompt."""
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(37)]
    prompts = [base[:n] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 14))] for n in (0, 8, 16, 21, 37, 37)]
    prompts += [[rng.randrange(vocab) for _ in range(n)] for n in (1, 2, 5, 30)]
    prompts.append(list(prompts[3]))
    rng.shuffle(prompts)
    return prompts


def hf_greedy(folder, prompts, dtype=torch.float64, max_new: int = MAX_NEW) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    # experts one by one, as the modelling code reads (transformers' grouped GEMMs take no float64)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, experts_implementation="eager").eval()
    return model_greedy(model, prompts, max_new)


def model_greedy(model, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    """A transformers (or PEFT) model's greedy new tokens for each prompt, one at a time."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def references(hf_folders):
    cache = {}

    def get(kind):
        if kind not in cache:
            prompts = shared_prefix_prompts(seed=len(kind))
            cache[kind] = prompts, hf_greedy(hf_folders[kind], prompts)
        return cache[kind]

    return get


def flock_greedy(folder, prompts, dtype="float64", **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(folder), dtype=dtype, **config)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def assert_no_leak(llm: LLM) -> None:
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(c == 0 for c in pool.ref_count)
    assert not llm.engine.has_unfinished()


BACKENDS = ["torch", "torch-cascade"]


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen2_yarn", "qwen3", "mistral", "phi3", "phi3_partial",
                                  "granite", "gemma", "gemma2", "gemma3", "qwen3_moe", "qwen3_moe_dense", "qwen2_moe",
                                  "mixtral", "smollm3"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers(hf_folders, references, kind, prefix_caching, attention):
    prompts, expected = references(kind)
    got, llm = flock_greedy(hf_folders[kind], prompts, enable_prefix_caching=prefix_caching, block_size=8,
                            attention=attention)
    assert got == expected
    assert_no_leak(llm)
    stats = llm.stats()
    if prefix_caching:
        assert stats["saving_rate"] > 0.2
    else:
        assert stats["saving_rate"] == 0.0


@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_longrope_factors_follow_max_model_len(hf_folders, references, attention):
    """LongRoPE (Phi-3-128k): the short factors while max_model_len stays within the original length, its default
    (transformers uses them for such sequences), the long ones for every position past it (transformers' for a sequence that
    passes it), each with its scaled cos and sin."""
    prompts, expected = references("phi3_longrope")  # at most 58 tokens, within the original 64
    got, llm = flock_greedy(hf_folders["phi3_longrope"], prompts, attention=attention)
    assert got == expected and llm.engine.max_model_len == 64  # the default, as vLLM's: the original length
    long = [[(7 * i + j) % 8192 for i in range(70 + j)] for j in range(3)]
    got, _ = flock_greedy(hf_folders["phi3_longrope"], long, max_model_len=256, attention=attention)
    assert got == hf_greedy(hf_folders["phi3_longrope"], long)


@pytest.mark.parametrize("layout", ["hub", "transformers modules"])
def test_gemma3_multimodal_checkpoint_runs_its_text_decoder(hf_folders, tmp_path, layout):
    """A Gemma3ForConditionalGeneration folder (a nested text_config, the decoder's tensors under its language
    model, a vision tower and projector beside them; named as the Hub's files or as transformers' modules):
    Flock runs the text decoder, and its greedy tokens are the multimodal model's on text prompts; without the
    image processor's files it takes no images."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = json.loads((hf_folders["gemma3"] / "config.json").read_text())
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=16)
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                  image_token_index=8191, boi_token_index=8189, eoi_token_index=8190)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    if layout != "hub":
        renames = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
                   "multi_modal_projector.": "model.multi_modal_projector."}
        tensors = load_file(tmp_path / "model.safetensors")
        save_file({next((new + k[len(old):] for old, new in renames.items() if k.startswith(old)), k): t
                   for k, t in tensors.items()}, tmp_path / "model.safetensors")
    (tmp_path / "tokenizer.json").write_bytes((hf_folders["gemma3"] / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_bytes((hf_folders["gemma3"] / "tokenizer_config.json").read_bytes())
    prompts = [[t % 8189 for t in p] for p in shared_prefix_prompts(seed=5)[:6]]  # no image tokens
    expected = model_greedy(model, prompts)
    got, llm = flock_greedy(tmp_path, prompts, dtype="float32")
    assert got == expected
    assert llm.engine.model_config.multimodal and llm.engine.model_config.model_type == "gemma3_text"
    with pytest.raises(ValueError, match="without its image processor"):  # no processor files: text alone
        llm.generate({"prompt": "a <start_of_image>", "multi_modal_data": {"image": "data:,"}})


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("chunk", [1, 3, 16, 4096])
def test_chunk_sizes(hf_folders, references, chunk, attention):
    prompts, expected = references("llama")
    got, llm = flock_greedy(hf_folders["llama"], prompts, max_num_batched_tokens=chunk, block_size=4,
                            attention=attention)
    assert got == expected
    assert llm.stats()["max_tokens_per_step"] <= chunk
    assert_no_leak(llm)


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_small_kv_budget(hf_folders, references, prefix_caching, attention):
    prompts, expected = references("qwen2")
    got, llm = flock_greedy(hf_folders["qwen2"], prompts, block_size=4, num_kv_blocks=16,
                            enable_prefix_caching=prefix_caching, max_num_batched_tokens=32, attention=attention)
    assert got == expected
    assert llm.stats()["preemptions"] > 0
    assert_no_leak(llm)


def test_start_up_pass_leaves_nothing_behind(hf_folders, references):
    """The CPU runner's start-up forward pass (a token budget larger than the cache: capped at the cache) writes
    blocks that no request has, counts no step, and changes no token."""
    llm = LLM(str(hf_folders["qwen2"]), dtype="float64", block_size=4, num_kv_blocks=16, max_num_batched_tokens=4096)
    assert llm.stats()["steps"] == 0
    assert_no_leak(llm)
    prompts, expected = references("qwen2")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                                                   ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_start_up_pass_runs_two_layers_and_keeps_all():
    """The start-up pass goes through the first and the last layer only (every layer needs the same activations)
    and leaves the model whole."""
    llm = LLM("flock/tiny", num_kv_blocks=64)
    model = llm.engine.runner.model
    ran = []
    hooks = [layer.register_forward_pre_hook(lambda m, _: ran.append(m.self_attn.layer_id)) for layer in model.layers]
    llm.engine.runner.warm_up(32)
    for hook in hooks:
        hook.remove()
    assert ran == [0, model.config.num_hidden_layers - 1] and model.config.num_hidden_layers > 2
    assert [layer.self_attn.layer_id for layer in model.layers] == list(range(model.config.num_hidden_layers))


def test_a_steps_logits_are_written_into_one_kept_buffer():
    """The runner keeps one float32 logits buffer and the sampler one of log-softmax rows (a fresh tensor of a few
    hundred rows would fault its pages in at every step; prompt logprobs log-softmax the logits in place); tokens
    and logprobs are those of fresh tensors."""
    llm = LLM("flock/tiny", dtype="bfloat16", num_kv_blocks=64, block_size=8, enable_prefix_caching=False)
    runner = llm.engine.runner
    prompts = [{"prompt_token_ids": list(range(30 + i, 50 + i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    kept = llm.generate(prompts, params, use_tqdm=False)
    buffer = runner.logits
    assert buffer is not None and buffer.dtype == torch.float32 and len(buffer) >= len(prompts)
    runner._logits_out = lambda rows: None
    runner.sampler._log_softmax = log_softmax  # the sampler's kept log-softmax rows too
    fresh = llm.generate(prompts, params, use_tqdm=False)
    assert runner.logits is buffer
    assert all(o.prompt_logprobs[1] is not None for o in kept)
    assert ([(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in kept]
            == [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in fresh])


def test_max_num_seqs_and_single_prompt(hf_folders, references):
    prompts, expected = references("mistral")
    got, _ = flock_greedy(hf_folders["mistral"], prompts, max_num_seqs=2, block_size=16)
    assert got == expected
    got, _ = flock_greedy(hf_folders["mistral"], prompts[:1])
    assert got == expected[:1]


def prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position, computed in chunks through the engine's steps."""
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    logits = []
    with torch.inference_mode():
        while engine.scheduler.waiting or engine.scheduler.running:
            plan = engine.scheduler.schedule()
            input_ids, positions, layout, _ = engine.runner._prepare(plan)
            hidden = engine.runner.model(input_ids, positions, engine.runner.backend.build_metadata(layout))
            logits.append(engine.runner.model.compute_logits(hidden))
            n = len(plan.sampling())
            engine._postprocess(plan, StepOutput([[0]] * n, [[None]] * n))
    return torch.cat(logits)


@pytest.mark.parametrize("ops", ["auto", "torch"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3", "phi3_partial", "granite", "gemma", "gemma2",
                                  "gemma3", "qwen3_moe", "qwen2_moe", "mixtral", "smollm3"])
def test_float32_logits_match_transformers(hf_folders, kind, ops):
    from transformers import AutoModelForCausalLM

    prompt = shared_prefix_prompts(seed=1)[0] * 3
    ref = AutoModelForCausalLM.from_pretrained(hf_folders[kind], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    got = prefill_logits(LLM(str(hf_folders[kind]), dtype="float32", block_size=8, max_num_batched_tokens=10,
                             ops=ops), prompt)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ops", ["auto", "fused", "packed"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_float32_greedy_matches_transformers_on_fast_paths(hf_folders, kind, ops):
    from flock.model import fused_ops, linear

    why = {"fused": fused_ops, "packed": linear}.get(ops, fused_ops).unavailable(torch.float32, torch.device("cpu"))
    if why:
        pytest.skip(why)
    prompts = shared_prefix_prompts(seed=len(kind))
    expected = hf_greedy(hf_folders[kind], prompts, dtype=torch.float32)
    got, llm = flock_greedy(hf_folders[kind], prompts, dtype="float32", ops=ops, block_size=8,
                            max_num_batched_tokens=24, attention="torch-cascade")
    assert got == expected
    paths = llm.engine.runner.paths
    assert paths["elementwise"].startswith("fused C kernels") == (ops in ("auto", "fused"))
    assert paths["gemm"].startswith("oneDNN") == (ops in ("auto", "packed"))


@pytest.mark.parametrize("kind", ["mistral", "phi3", "gemma2", "gemma3"])
def test_cpu_kernel_runs_sliding_window_models(hf_folders, kind):
    """Every step of a sliding-window model (windows of 10 to 20 tokens under prompts of up to 50, chunks of up
    to 24; Gemma's on some layers, with capped scores for Gemma 2) on the CPU attention kernel, its float32 greedy
    tokens transformers'."""
    from flock.attention.cpu import CpuMetadata

    prompts = shared_prefix_prompts(seed=len(kind))
    expected = hf_greedy(hf_folders[kind], prompts, dtype=torch.float32)
    llm = LLM(str(hf_folders[kind]), dtype="float32", attention="cpu", block_size=8, max_num_batched_tokens=24)
    backend = llm.engine.runner.backend
    if not backend.uses_kernel(torch.device("cpu")):
        pytest.skip("the CPU attention kernel is unavailable here")
    kinds = []
    build = backend.build_metadata
    backend.build_metadata = lambda layout: kinds.append(build(layout)) or kinds[-1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    plans = [p for m in kinds for p in getattr(m, "parts", {None: m}).values()]  # a plan per window (Gemma's)
    assert plans and all(isinstance(p, CpuMetadata) for p in plans)
    assert len(plans) == len(kinds) * (2 if kind.startswith("gemma") else 1)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_bfloat16_fast_paths_stay_within_rounding_of_the_reference(hf_folders, kind):
    """The fused kernels and prepacked GEMMs against plain PyTorch, both bf16: equal here (the rare last-bit
    differences of RMSNorm and SiLU did not occur); elsewhere (another GEMM kernel) held to a few bf16 units."""
    prompt = shared_prefix_prompts(seed=2)[0] * 3
    runs = [prefill_logits(LLM(str(hf_folders[kind]), dtype="bfloat16", block_size=8, max_num_batched_tokens=10,
                               ops=ops), prompt).float() for ops in ("torch", "auto")]
    ref, got = runs
    atol = 0.03 * ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=0, atol=atol)
    top2 = ref.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * atol
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("num_kv_blocks", [None, 24])
def test_batchllm_scheduler_matches_transformers(hf_folders, references, attention, num_kv_blocks):
    prompts, expected = references("llama")
    got, llm = flock_greedy(hf_folders["llama"], prompts, scheduler="batchllm", block_size=4,
                            num_kv_blocks=num_kv_blocks, max_num_batched_tokens=24, attention=attention)
    assert got == expected
    assert_no_leak(llm)


@pytest.mark.parametrize("scheduler", ["lpm", "dfs-weight", "feather", "feather:ucb", "feather:qlearning", "priority"])
@pytest.mark.parametrize("num_kv_blocks", [None, 24])
def test_online_schedulers_match_transformers(hf_folders, references, scheduler, num_kv_blocks):
    name, _, policy = scheduler.partition(":")
    prompts, expected = references("llama")
    got, llm = flock_greedy(hf_folders["llama"], prompts, scheduler=name, feather_policy=policy or "static",
                            block_size=4, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=24, max_num_seqs=4,
                            attention="torch-cascade")
    assert got == expected
    assert_no_leak(llm)


@pytest.mark.parametrize("scheduler", ["fcfs", "batchllm", "feather"])
def test_prefix_ending_inside_a_block_is_copied_not_recomputed(hf_folders, references, scheduler):
    """Prompts admitted a step apart share prefixes of 21 and 37 tokens: 5 tokens into a block of 8. The later
    ones copy those tokens' KV from the earlier one's block; the tokens are the reference's all the same."""
    prompts, expected = references("llama")
    got, llm = flock_greedy(hf_folders["llama"], prompts, scheduler=scheduler, block_size=8, max_num_seqs=2,
                            max_num_batched_tokens=16, attention="torch-cascade")
    assert got == expected
    assert llm.stats()["copied_prefill_tokens"] > 0
    assert_no_leak(llm)
