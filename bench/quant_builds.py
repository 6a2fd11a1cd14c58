"""Builds of the quantized GEMM side by side in a whole engine: decode with the builds alternating in one process.

    python -m bench.quant_builds OLD.c flock/model/csrc/quant_gemm.c                    # SmolLM2, one request
    python -m bench.quant_builds A.c B.c --model /work/models/qbench/llama-1b-Q4_K_M.gguf --tokens 64
    python -m bench.quant_builds A.c B.c --requests 8                                   # decode steps of 8 rows

Each source (a copy of `flock/model/csrc/quant_gemm.c` beside it, so that it finds the same headers) gets its own
engine on the same GGUF file; `flock.model.quant.KERNEL` is set to a build before each of its engine's calls (the
step program takes the library when it is built, the lm_head at every call). A round decodes `--requests` fresh
prompts of the same words, `--tokens` new tokens each, on every engine in turn; the table gives each build's
decode tokens/s per round and their median, and the step program's op times per decode step of a last, timed
round. A build whose tokens differ from the first's is marked. The machine's memory bandwidth swings over minutes
here, so only builds alternating in one run are compared.
"""

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from bench.harness import machine
from bench.harness.report import markdown_table
from flock import LLM, SamplingParams
from flock.engine.loop import run
from flock.model import quant

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Story number"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", type=Path, help="copies of quant_gemm.c in flock/model/csrc/")
    p.add_argument("--model", default="flock/smollm2", help="a GGUF file (or flock/smollm2)")
    p.add_argument("--requests", type=int, default=1, help="requests decoding together (rows of a decode step)")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def decode(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of one batch (from the step after its prompts' prefill) and its tokens."""
    engine = llm.engine
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)) for p in prompts]
    start = None
    for _ in run(engine):
        if start is None and all(r.output_token_ids for r in reqs):
            start = time.perf_counter()
    seconds = time.perf_counter() - start
    return len(reqs) * (tokens - 1) / seconds, [r.output_token_ids for r in reqs]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    builds = [(s.name, dataclasses.replace(quant.KERNEL, source=s.resolve())) for s in args.sources]
    engines = []
    for _, kernel in builds:
        quant.KERNEL = kernel
        engines.append(LLM(args.model))
    print(machine.header("quant_builds"))
    print(f"# {args.model}: {engines[0].engine.runner.paths.get('quantized', 'no quantized weights')}; "
          f"{args.requests} request(s) x {args.tokens} tokens, {args.rounds} rounds")
    tokenizer = engines[0].get_tokenizer()
    rates = {name: [] for name, _ in builds}
    same = {name: True for name, _ in builds}
    for rnd in range(args.rounds + 2):  # a warm-up round, the rounds, a timed round
        prompts = [tokenizer.encode(f"{PROMPT} {rnd * args.requests + i}.") for i in range(args.requests)]
        first = None
        for (name, kernel), llm in zip(builds, engines):
            quant.KERNEL = kernel
            program = llm.engine.runner.model.step_program
            timed = rnd == args.rounds + 1 and program is not None
            if timed:
                program.op_seconds = {}
            rate, tokens = decode(llm, prompts, args.tokens)
            first = first or tokens
            same[name] &= tokens == first
            if timed:
                ops = {kind: s / ((args.tokens - 1) * 1e-3) for kind, s in program.op_seconds.items()}
                program.op_seconds = None
                print(f"# {name}: ms a decode step, " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                              sorted(ops.items(), key=lambda kv: -kv[1])))
            elif 0 < rnd <= args.rounds:
                rates[name].append(rate)
    rows = [[name, *(f"{r:.1f}" for r in rates[name]), f"{statistics.median(rates[name]):.1f}",
             "the first's" if same[name] else "OTHER"] for name, _ in builds]
    print(markdown_table(["build", *(f"round {i + 1}" for i in range(args.rounds)), "median tokens/s", "tokens"],
                         rows))


if __name__ == "__main__":
    main()
