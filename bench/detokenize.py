"""What a running request's text costs the engine per output: the text of every step of a request with stop
strings or a stream, decoded whole each step (Flock before its incremental detokenizer) vs Flock's
`IncrementalText` vs the tokenizers library's `DecodeStream` (what vLLM's incremental detokenizer runs), on the
model's own tokenizer; and, with `--engine`, a whole batch with and without a stop string.

    python -m bench.detokenize [--model flock/smollm2] [--lengths 256 1024 2048] [--engine]

The output is real text (the standard library's reference text, tokenized); each figure is the median of
`--repeats` runs of one request's whole output, token by token.
"""

import argparse
import time
from pathlib import Path

from tokenizers.decoders import DecodeStream

from bench.harness import machine
from bench.harness.report import OUT, markdown_table, write_json
from bench.harness.stdlib_text import module_docs
from bench.harness.timing import median_time
from flock import LLM, SamplingParams
from flock.engine.detokenizer import IncrementalText


def whole_each_step(tok, ids: list[int]) -> None:
    for k in range(1, len(ids) + 1):
        tok.decode(ids[:k], skip_special_tokens=True)


def incremental(tok, ids: list[int]) -> None:
    text = IncrementalText(tok, True)
    for k in range(1, len(ids) + 1):
        text.update(ids[:k])


def decode_stream(tok, ids: list[int]) -> None:
    stream, backend = DecodeStream(skip_special_tokens=True), tok.backend_tokenizer
    for t in ids:
        stream.step(backend, t)


def engine_rows(model: str, tokens: int, prompts: int) -> list[list]:
    llm = LLM(model)
    rows = []
    for stop in (None, ["zzqq never written"]):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, stop=stop)
        t0 = time.perf_counter()
        llm.generate([f"Write a long story about the number {i}." for i in range(prompts)], params, use_tqdm=False)
        rows.append(["a stop string" if stop else "none", prompts, tokens, f"{time.perf_counter() - t0:.2f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="flock/smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", type=Path, default=OUT / "detokenize.json")
    ap.add_argument("--engine", action="store_true", help="also a batch of 64 x 1,024 tokens, with and without a "
                                                          "stop string (minutes)")
    args = ap.parse_args()
    print(machine.header("detokenize", kernels=args.engine))
    tok = LLM(args.model, load_format="dummy").get_tokenizer()
    text = "\n\n".join(doc for _, doc in module_docs())[: 40 * max(args.lengths)]
    ids = tok.encode(text, add_special_tokens=False)
    rows, data = [], []
    for n in args.lengths:
        out = ids[:n]
        seconds = {name: median_time(lambda f=f: f(tok, out), args.repeats)
                   for name, f in (("whole", whole_each_step), ("incremental", incremental),
                                   ("decode_stream", decode_stream))}
        data.append({"tokens": n} | seconds)
        rows.append([n, f"{seconds['whole'] * 1e3:,.1f}", f"{seconds['incremental'] * 1e3:,.1f}",
                     f"{seconds['decode_stream'] * 1e3:,.1f}", f"{seconds['whole'] / seconds['incremental']:.0f}x",
                     f"{seconds['incremental'] / seconds['decode_stream']:.1f}x"])
    print(markdown_table(["output tokens", "whole text each step, ms", "IncrementalText, ms",
                          "DecodeStream (vLLM's), ms", "whole / incremental", "incremental / DecodeStream"], rows))
    result = {"model": args.model, "per_request": data}
    if args.engine:
        engine = engine_rows(args.model, 1024, 64)
        print()
        print(markdown_table(["stop strings", "prompts", "tokens each", "seconds"], engine))
        result["engine"] = engine
    print(f"\nwrote {write_json(args.output, result)}")


if __name__ == "__main__":
    main()
