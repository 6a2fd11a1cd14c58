from dataclasses import dataclass, field, fields

from flock.kv.fp8 import KV_CACHE_DTYPES
from flock.lora.request import lora_requests
from flock.sampling_params import LOGPROBS_MODES, MAX_LOGPROBS
from flock.spec.config import SpeculativeConfig

# the model's speed paths: both (where the CPU and dtype allow), none (plain PyTorch, the reference), or one
OPS = ("auto", "torch", "fused", "packed")
# flock.model.quant (GGUF blocks), flock.model.hf_quant (GPTQ, AWQ, compressed-tensors, fp8)
# vLLM's: what logprobs hold: log-softmax or logits, of the model's output (raw) or of what the token is drawn
# from (processed: after penalties, bias, temperature and truncations)
QUANTIZATION = ("auto", "gguf", "gptq", "awq", "compressed-tensors", "fp8", "none", "q8_0", "q4_0")


def option(default, help: str, **cli):
    """A config field with its command-line help (`flock.engine.args` makes the flags from these)."""
    return field(default=default, metadata={"help": help, **cli})


# vLLM engine keywords whose value Flock always runs with (accepted with that value, refused with another), and
# those no value of which changes what Flock does (it runs no model code from a folder, logs no stats, scales each
# fp8 KV row by its own values, and serves what the model's architecture says: generation, embeddings, or
# classification, whatever runner, task or conversion is named)
VLLM_AS_FLOCK_RUNS = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
VLLM_NO_EFFECT = {"trust_remote_code", "disable_log_stats", "max_loras", "max_cpu_loras", "calculate_kv_scales",
                  "runner", "convert", "task", "gpu_memory_utilization", "enforce_eager", "enable_chunked_prefill",
                  "revision", "download_dir"}
# vLLM keywords of one meaning here: scheduling_policy priority picks the priority scheduler (fcfs: the one named);
# tokenizer_mode auto and hf are the model's Hugging Face tokenizer, nothing else is; vLLM's None defaults


@dataclass
class EngineConfig:
    """Engine settings; names follow vLLM's where vLLM has one."""

    model: str = option("flock/tiny", "built-in model (flock/smollm2, a real chat model; flock/tiny, random weights), "
                        "a local Hugging Face folder, or a GGUF file (or a folder holding one)")
    tokenizer: str | None = option(None, "tokenizer folder or GGUF file (default: the model's)")
    hf_overrides: dict | None = option(
        None, "keys that replace the model's config.json ones, as vLLM's JSON, e.g. a causal LM reranker as a "
        "classifier: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
        "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'")
    dtype: str = option("auto", "auto (the model's; float32 on a CPU without AVX512-BF16 or AMX), float32, bfloat16 or "
                        "float64 (float16 runs as bfloat16 on CPU)")
    load_format: str = option("auto", "auto, safetensors, gguf, or dummy (random weights)")
    quantization: str = option("auto", "auto: a GGUF file's quantized weights, or a Hugging Face folder's GPTQ, AWQ "
                               "or compressed-tensors integers, stay quantized and run on int8 kernels, but for "
                               "float64 models, GPUs, and small models on CPUs with AMX (under 1 GiB as bf16: "
                               "Flock's AMX GEMM runs batches faster); fp8 weights are dequantized at load; gguf, "
                               "gptq, awq, compressed-tensors or fp8: the checkpoint's method, kept wherever the "
                               "kernels run; none: dequantize every weight at load; q8_0 or q4_0: also quantize "
                               "float weights to that type at load",
                               choices=QUANTIZATION)
    device: str = option("auto", "auto, cpu or cuda")
    seed: int = option(0, "seed of random weights and of requests that set none")
    max_logprobs: int = option(MAX_LOGPROBS, "most logprobs (alternatives) a request may ask for per token; -1: "
                               "the whole vocabulary, which requests ask for with -1")
    logprobs_mode: str = option("raw_logprobs", "what logprobs hold: the model's log-softmax (raw_logprobs) or "
                                "logits (raw_logits), or those of the distribution tokens are drawn from, after "
                                "penalties, temperature and truncations (processed_logprobs, processed_logits)",
                                choices=LOGPROBS_MODES)
    block_size: int = option(16, "tokens per KV block")
    enable_prefix_caching: bool = option(True, "turn off the prefix cache", flag="--no-prefix-caching")
    max_num_seqs: int = option(256, "most requests in one step")
    max_num_batched_tokens: int = option(2048, "most tokens in one step")
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's; -1: the model's, at "
                                              "most what the KV cache holds, as vLLM's -1)")
    num_kv_blocks: int | None = option(None, "KV budget in blocks ...")
    kv_cache_memory_bytes: int | None = option(None, "... or in bytes (default: 1 GiB)")
    kv_cache_dtype: str = option("auto", "the KV cache's elements: auto (the model's dtype), or fp8 (= fp8_e4m3) or "
                                 "fp8_e5m2: a row of fp8 codes and a scale per token and KV head, about half the "
                                 "bytes", choices=KV_CACHE_DTYPES)
    kv_cache_disk_dir: str | None = option(
        None, "a folder that keeps full KV blocks beyond memory, a tier below the prefix cache (as SGLang's "
        "hierarchical cache and LMCache's local disk do): prefixes evicted from memory are read back instead of "
        "computed, and a later run of the same model (its files, dtype and KV layout) finds the blocks an earlier "
        "one wrote")
    kv_cache_disk_bytes: int = option(16 << 30, "the disk tier's size in bytes for each model's subfolder (16 GiB): "
                                      "the least recently used blocks beyond it are deleted")
    scheduler: str = option("fcfs", "the scheduling policy")
    feather_policy: str = option("static", "batching policy of the feather scheduler")
    attention: str = option("auto", "attention backend (auto: the fastest that runs here)")
    ops: str = option("auto", "fused C elementwise kernels and prepacked GEMM weights (auto: where the CPU and dtype "
                      "allow), torch: plain PyTorch (the reference), or only one of the two", choices=OPS)
    chat_template: str | None = option(None, "a Jinja chat template, or a file holding one, for chats instead of "
                                       "the tokenizer's own (vLLM's --chat-template)")
    generation_config: str = option(
        "auto", "defaults for the sampling fields a request leaves unset: auto (the model folder's "
        "generation_config.json, as vLLM applies it: temperature, top_p, top_k, min_p, the penalties, max_new_tokens "
        "as max_tokens), vllm (none: the API's own defaults), or a folder holding a generation_config.json")
    override_generation_config: dict | None = option(
        None, "JSON: generation config fields over those (with vllm: alone), as vLLM's, e.g. '{\"temperature\": 0.5}'")
    structured_outputs_any_whitespace: bool = option(
        False, "let JSON outputs put any whitespace between tokens (a small model can loop on it), for requests "
        "whose structured_outputs.disable_any_whitespace is not set", flag="--structured-outputs-any-whitespace")

    speculative_config: dict | None = option(
        None, "speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4}' (drafts from prompt lookup) or '{\"method\": \"draft_model\", \"model\": "
        "PATH, \"num_speculative_tokens\": 4}' (a small model of the same vocabulary drafting greedily), verified in "
        "each request's next step (outputs distributed as without drafts; greedy ones unchanged)")

    enable_lora: bool = option(False, "serve LoRA adapters saved by PEFT (LoRARequest; the API's model names of "
                               "--lora-modules); dense MLPs then run their activation after the gate_up GEMM")
    max_lora_rank: int | None = option(None, "refuse LoRA adapters of a higher rank (default: any)")
    lora_modules: list[str] | None = option(
        None, "LoRA adapters to load at start, each NAME=PATH or vLLM's JSON {\"name\": ..., \"path\": ...}; "
        "requests pick one by its name as their model (turns on --enable-lora)", nargs="+")

    def speculative(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        if kwargs.pop("scheduling_policy", "fcfs") == "priority":
            kwargs["scheduler"] = "priority"
        if kwargs.pop("tokenizer_mode", "auto") not in ("auto", "hf"):
            raise ValueError("tokenizer_mode: Flock runs the model's Hugging Face tokenizer (auto or hf)")
        for name in ("quantization", "enable_prefix_caching"):  # None is vLLM's "the default"
            if name in kwargs and kwargs[name] is None:
                del kwargs[name]
        dtype = kwargs.get("dtype")
        if dtype is not None and not isinstance(dtype, str):  # a torch.dtype, as vLLM takes one
            kwargs["dtype"] = str(dtype).removeprefix("torch.")
        if callable(kwargs.get("hf_overrides")):
            raise ValueError("hf_overrides: Flock takes a dict of config keys (vLLM's callable form changes a "
                             "transformers config object, which Flock does not build)")
        for name, value in list(kwargs.items()):
            if name in VLLM_AS_FLOCK_RUNS and value != VLLM_AS_FLOCK_RUNS[name]:
                raise ValueError(f"{name}={value!r} is not supported: Flock runs as {name}={VLLM_AS_FLOCK_RUNS[name]!r}")
            if name in VLLM_AS_FLOCK_RUNS or name in VLLM_NO_EFFECT:
                del kwargs[name]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        config = cls(model=model, **kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the vocabulary) or at least 0, got {self.max_logprobs}")
        if self.ops not in OPS:
            raise ValueError(f"ops must be one of {', '.join(OPS)}, got {self.ops!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATION:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION)}, got {self.quantization!r}")
        spec = self.speculative()
        if spec is not None and spec.quantization not in (None, *QUANTIZATION):
            raise ValueError(f"speculative_config.quantization must be one of {', '.join(QUANTIZATION)}, got "
                             f"{spec.quantization!r}")
        if self.lora_modules:
            self.enable_lora = True
            lora_requests(self.lora_modules)
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be positive, got {self.max_lora_rank}")
        if self.kv_cache_disk_bytes < 0:
            raise ValueError(f"kv_cache_disk_bytes must be at least 0, got {self.kv_cache_disk_bytes}")
        if self.max_model_len is not None and (self.max_model_len < -1 or self.max_model_len == 0):
            raise ValueError(f"max_model_len must be positive, or -1 (what fits), got {self.max_model_len}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
