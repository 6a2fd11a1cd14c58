"""Offline batches of token ids through Flock's LLM: the workload, one engine condition's result, and the
block-level bounds a prefix cache of whole 16-token blocks can reach (vLLM's side is bench/harness/vllm.py)."""

import gc
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.machine import OthersCPU

__all__ = ["BLOCK", "Workload", "Result", "random_tokens", "shared_workload", "unshared_workload",
           "warmup_prompts", "blocks_needed", "block_bound_tokens", "kv_bytes_per_token", "hf_folder", "run_flock"]

BLOCK = 16
TOKEN_RANGE = (100, 31999)  # clear of the special tokens, inside the bench models' 32,000-token vocabulary


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    gen: int
    bound: float  # the best possible saving rate: 1 - unique prompt tokens / logical prompt tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


@dataclass
class Result:
    engine: str
    caching: bool | None  # prefix caching on/off; None: the engine has none
    wall_s: float = float("nan")
    prompt_tokens: int = 0
    generated_tokens: int = 0
    saving_rate: float | None = None
    error: str | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.engine + {True: ", prefix caching on", False: ", prefix caching off", None: ""}[self.caching]

    def per_s(self, tokens: int) -> float:
        return tokens / self.wall_s

    @property
    def total_per_s(self) -> float:
        return self.per_s(self.prompt_tokens + self.generated_tokens)


# -- workloads -------------------------------------------------------------------------------------------------
def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(*TOKEN_RANGE) for _ in range(n)]


def shared_workload(name: str, rng: random.Random, groups: int, per_group: int, prefix: int, distinct: int,
                    gen: int) -> Workload:
    """`groups` x `per_group` prompts: a group prefix of `prefix` tokens + `distinct` own tokens, shuffled."""
    prefixes = [random_tokens(rng, prefix) for _ in range(groups)]
    prompts = [p + random_tokens(rng, distinct) for p in prefixes for _ in range(per_group)]
    rng.shuffle(prompts)
    n = groups * per_group
    return Workload(name, prompts, gen, 1 - (groups * prefix + n * distinct) / (n * (prefix + distinct)))


def unshared_workload(name: str, rng: random.Random, n: int, length: int, gen: int) -> Workload:
    return Workload(name, [random_tokens(rng, length) for _ in range(n)], gen, 0.0)


def warmup_prompts(seed: int, length: int, n: int = 4) -> list[list[int]]:
    """Prompts for an engine's first calls; drawn with seed + 1, so they share no block with a workload's."""
    rng = random.Random(seed + 1)
    return [random_tokens(rng, length) for _ in range(n)]


def _block_hashes(p: list[int]):
    h = 0
    for b in range(len(p) // BLOCK):
        h = hash((h, tuple(p[b * BLOCK:(b + 1) * BLOCK])))
        yield b, h


def blocks_needed(prompts: list[list[int]], gen: int) -> int:
    """KV blocks the whole batch holds at once, full prompt blocks shared by several prompts stored once."""
    own, chains = 0, set()
    for p in prompts:
        own += math.ceil((len(p) + gen) / BLOCK) - len(p) // BLOCK
        chains.update(h for _, h in _block_hashes(p))
    return own + len(chains)


def block_bound_tokens(prompts: list[list[int]]) -> int:
    """Fewest prompt tokens an engine sharing whole 16-token blocks computes (each prompt at least its last)."""
    seen: set[int] = set()
    computed = 0
    for p in prompts:
        cached = 0
        for b, h in _block_hashes(p):
            if h in seen:
                cached = (b + 1) * BLOCK
            seen.add(h)
        computed += len(p) - min(cached, len(p) - 1)
    return computed


def kv_bytes_per_token(folder: Path) -> int:
    c = json.loads((folder / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2  # K and V, bf16


def hf_folder(model: str, out: Path, dtype: str = "bfloat16") -> Path:
    """A Hugging Face folder both engines load: a folder as given, or a built-in (flock/bench-mid,
    flock/smollm2, ...) saved under `out` in `dtype` (random weights for the bench shapes; a few seconds)."""
    if Path(model).is_dir():
        return Path(model).resolve()
    from flock.model import save_model

    name = model.replace("/", "-") + ("" if dtype == "bfloat16" else f"-{dtype}")
    return save_model(model, out / name, dtype=dtype, seed=0)


# -- Flock -----------------------------------------------------------------------------------------------------
STATS = ("wall_seconds", "schedule_seconds", "model_seconds", "steps", "preemptions", "peak_kv_blocks",
         "num_kv_blocks", "computed_prefill_tokens", "cached_prefill_tokens", "mean_tokens_per_step",
         "mean_requests_per_step", "disk_read_blocks", "disk_saved_blocks")


def run_flock(folder: Path, w: Workload, label: str, warmup: list[list[int]], *, scheduler: str = "fcfs",
              caching: bool = True, sort: bool = False, sampling: dict | None = None, **engine_kw) -> Result:
    """One Flock condition: a fresh LLM (bf16, 16-token blocks, `engine_kw`), warmed up on `warmup`, then
    the workload with ignore_eos, greedy or with the SamplingParams fields `sampling`. `sort`: prompts sorted
    lexicographically before generate, outputs mapped back (the sort is inside wall s). A failing condition is
    returned as an error, not raised."""
    from flock import LLM, SamplingParams

    llm = None
    try:
        llm = LLM(str(folder), dtype="bfloat16", enable_prefix_caching=caching, scheduler=scheduler,
                  block_size=BLOCK, **engine_kw)
        llm.generate([{"prompt_token_ids": p} for p in warmup],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        params = SamplingParams(**{"temperature": 0, "max_tokens": w.gen, "ignore_eos": True, **(sampling or {})})
        with OthersCPU() as others:
            start = time.perf_counter()
            order = sorted(range(len(w.prompts)), key=w.prompts.__getitem__) if sort else range(len(w.prompts))
            outs = llm.generate([{"prompt_token_ids": w.prompts[i]} for i in order], params, use_tqdm=False)
            outputs: list[list[int]] = [[] for _ in w.prompts]
            for i, o in zip(order, outs):
                outputs[i] = list(o.outputs[0].token_ids)
            wall = time.perf_counter() - start
        s = llm.stats()
        steps = s.get("tokens_per_step") or list(llm.engine.stats.tokens_per_step)
    except Exception as e:  # noqa: BLE001 - a failing condition is a finding, the others still run
        print(f"{label}: {type(e).__name__}: {e}", flush=True)
        return Result(label, caching, error=f"{type(e).__name__}: {e}"[:200])
    finally:
        llm = None
        gc.collect()
    extra = {k: s[k] for k in STATS if k in s}
    extra |= {"others_cpu": others.fraction, "tokens_per_step": steps, "scheduler": scheduler, "sorted": sort,
              "recomputed_decode_tokens": s["computed_decode_tokens"] - len(w.prompts) * (w.gen - 1)}
    return Result(label, caching, wall, s["logical_prefill_tokens"], s["generated_tokens"], s["saving_rate"],
                  outputs=outputs, extra=extra)
