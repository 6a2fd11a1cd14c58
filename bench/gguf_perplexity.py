"""Perplexity of the real SmolLM2-135M-Instruct from its Q8_0 and Q4_K_M GGUF files, on text no one here wrote
(the standard library's docstrings): llama.cpp's `llama-perplexity -c 512` vs Flock with the weights kept
quantized vs Flock dequantized to float32 (quantization="none"), all on the same token ids. Bar: within 1%.

Flock reproduces llama-perplexity's chunking exactly (tools/perplexity/perplexity.cpp): the text tokenized with
special tokens (BOS where the vocabulary adds one), cut into len // ctx chunks of ctx tokens, each chunk's first
token replaced by BOS when the vocabulary adds one, and in each chunk the tokens at positions ctx/2 + 1 .. ctx - 1
scored (the logits of positions ctx/2 .. ctx - 2). Flock's logprobs come from `SamplingParams(max_tokens=1,
prompt_logprobs=0)` on those chunks.

The token ids are llama.cpp's own (llama-server's /tokenize on the same file; llama-tokenize is not built);
Flock's tokenizer is checked against them, and llama-perplexity's chunk count against their number.

    python -m bench.gguf_perplexity                 # ~30k tokens (first use: converts and quantizes SmolLM2)
    python -m bench.gguf_perplexity --tokens 2048 --quants Q8_0      # a dry run
"""

import argparse
import gc
import math
import time
from pathlib import Path

import torch

from bench.harness import gguf_models, llama_cpp, machine
from bench.harness.quant_engine import engine_kwargs, engine_paths, has_quantization_field, quant_path
from bench.harness.report import OUT, args_dict, markdown_table, write_json
from bench.harness.stdlib_text import member_docs, module_docs

QUANTS = ("Q8_0", "Q4_K_M")
BAR = 0.01


# -- the text and its token ids ----------------------------------------------------------------------------------
def stdlib_text(tokens: int, count) -> str:
    """Module docstrings, then public members' docstrings, joined by blank lines until `count(text)` reaches
    `tokens` (it is counted as pieces are added, so the text ends a little above)."""
    pieces, total = [], 0
    for _, doc in module_docs() + member_docs():
        pieces.append(doc)
        total += count(doc)
        if total >= tokens:
            break
    return "\n\n".join(pieces) + "\n"


def bos_of(server: llama_cpp.LlamaServer) -> int | None:
    """The BOS id llama.cpp adds (None where its vocabulary adds none): tokenizing with and without special tokens."""
    with_special, plain = server.tokenize("Hello", True), server.tokenize("Hello", False)
    return with_special[0] if len(with_special) == len(plain) + 1 else None


def chunks(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: len // ctx of ctx tokens, each starting with BOS where the vocabulary adds one."""
    out = []
    for i in range(len(ids) // ctx):
        chunk = ids[i * ctx:(i + 1) * ctx]
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def compare_tokens(flock_ids: list[int], llama_ids: list[int]) -> dict:
    """Where Flock's tokenizer and llama.cpp's part: the first position and the differing spans (llama.cpp's
    pre-tokenizers are regex ports of Hugging Face's and part in places, e.g. around newlines)."""
    import difflib

    spans = [op for op in difflib.SequenceMatcher(None, flock_ids, llama_ids, autojunk=False).get_opcodes()
             if op[0] != "equal"]
    return {"flock_tokens": len(flock_ids), "llama_tokens": len(llama_ids), "identical": not spans,
            "first_difference": spans[0][3] if spans else None, "differing_spans": len(spans),
            "spans": [{"flock": flock_ids[a:b], "llama": llama_ids[c:d], "at": c} for _, a, b, c, d in spans[:20]]}


# -- Flock -------------------------------------------------------------------------------------------------------
def flock_perplexity(gguf: Path, parts: list[list[int]], ctx: int, threads: int, **kwargs) -> dict:
    """Perplexity over the scored positions of every chunk, from Flock's prompt logprobs."""
    from flock import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(str(gguf), **kwargs)
    paths = engine_paths(llm, str(gguf))
    dtype, paths = paths["dtype"].removeprefix("torch."), paths["paths"]
    first = ctx // 2
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": c} for c in parts],
                           SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    wall = time.perf_counter() - start
    nll, count = 0.0, 0
    for chunk, out in zip(parts, outputs):
        for p in range(first + 1, ctx):
            entry = out.prompt_logprobs[p]
            assert entry.token_id == chunk[p], (entry.token_id, chunk[p])
            nll -= entry.logprob
            count += 1
    del llm, outputs
    gc.collect()
    return {"ppl": math.exp(nll / count), "scored_tokens": count, "wall_s": wall, "dtype": dtype, "paths": paths}


def flock_kwargs(mode: str, dtype: str) -> dict:
    """quantized: `dtype` (auto: the engine's choice), the file's blocks kept; none: dequantized at load, float32."""
    if mode == "none":
        return {"dtype": "float32", **engine_kwargs("none")}
    return {"dtype": dtype, **engine_kwargs("quantized")}


# -- report ------------------------------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> str:
    return f"{a / b:.4f} ({'yes' if abs(a / b - 1) <= BAR else 'NO'})"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    llama_cpp.add_argument(p)
    p.add_argument("--work", type=Path, default=gguf_models.WORK, help="where the GGUF files are kept (%(default)s)")
    p.add_argument("--quants", default=",".join(QUANTS), help="comma-separated llama-quantize types (F16 too)")
    p.add_argument("--files", help="comma-separated GGUF files of one vocabulary to score instead of SmolLM2's (any "
                                   "Llama / Qwen2 / Mistral file)")
    p.add_argument("--tokens", type=int, default=30000, help="length of the text, in tokens (about)")
    p.add_argument("--ctx", type=int, default=512, help="llama-perplexity -c")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="dtype of Flock's quantized run (the none run is float32)")
    p.add_argument("--out", type=Path, default=OUT / "gguf_perplexity.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    llama = llama_cpp.find_or_exit(args.llama_cpp)
    torch.set_num_threads(args.threads)
    files = ({Path(f).name: Path(f) for f in args.files.split(",")} if args.files
             else gguf_models.ensure("smollm2", args.quants.split(","), llama, args.work))
    print(f"# gguf_perplexity: {machine.cpu_line()}")
    print(f"# threads: {args.threads} for both engines; {machine.load_note()}")
    print(f"# Flock's quantized GEMM (flock.model.quant): {quant_path()}")
    from flock.model import resolve_model
    from flock.tokenizer import load_tokenizer

    if not has_quantization_field():
        print("# NOTE: this Flock has no `quantization` engine field: both Flock runs dequantize at load")
    first_file = next(iter(files.values()))
    tokenizer = load_tokenizer(resolve_model(str(first_file)).tokenizer_path)
    text = stdlib_text(args.tokens, lambda s: len(tokenizer.encode(s, add_special_tokens=False)))
    text_file = args.out.with_suffix(".txt")
    text_file.parent.mkdir(parents=True, exist_ok=True)
    text_file.write_text(text, encoding="utf-8")
    with llama.server(first_file, args.threads, 1, args.ctx) as server:
        ids, bos = server.tokenize(text, True), bos_of(server)
    tokens = compare_tokens(tokenizer.encode(text, add_special_tokens=True), ids)
    parts = chunks(ids, args.ctx, bos)
    print(f"# text: {len(text):,} characters of standard-library docstrings ({text_file}); llama.cpp's tokens "
          f"(llama-server /tokenize): {len(ids):,}, BOS {'added' if bos is not None else 'not added'}; Flock's "
          f"tokenizer: {tokens['flock_tokens']:,} tokens, "
          + ("identical ids" if tokens["identical"] else
             f"{tokens['differing_spans']} differing spans, the first at {tokens['first_difference']} (Flock "
             "scores llama.cpp's ids)"))
    print(f"# {len(parts)} chunks of {args.ctx}, {args.ctx - args.ctx // 2 - 1} tokens scored in each")

    results, rows = {}, []
    for quant, gguf in files.items():
        r = results[quant] = {"file": str(gguf), "file_bytes": gguf.stat().st_size}
        start = time.perf_counter()
        r["llama"] = llama.perplexity(gguf, text_file, args.ctx, args.threads)
        r["llama"]["wall_s"] = time.perf_counter() - start
        if r["llama"]["chunks"] != len(parts):
            print(f"# WARNING {quant}: llama-perplexity used {r['llama']['chunks']} chunks, Flock {len(parts)}: "
                  "the token counts differ")
        r["quantized"] = flock_perplexity(gguf, parts, args.ctx, args.threads, **flock_kwargs("quantized", args.dtype))
        r["none"] = flock_perplexity(gguf, parts, args.ctx, args.threads, **flock_kwargs("none", args.dtype))
        ll, fq, fn = r["llama"]["ppl"], r["quantized"]["ppl"], r["none"]["ppl"]
        rows.append([quant, f"{ll:.4f} ± {r['llama']['ppl_error']:.4f}", f"{fq:.4f}", f"{fn:.4f}",
                     _ratio(fq, ll), _ratio(fq, fn), _ratio(fn, ll)])
    for quant, r in results.items():
        for mode in ("quantized", "none"):
            f = r[mode]
            print(f"# Flock {mode} ({quant}): {f['dtype']}, "
                  + "; ".join(f"{k}: {v}" for k, v in f["paths"].items()))
    print()
    print(markdown_table(["file", "llama-perplexity", "Flock quantized", "Flock none (float32)",
                          "quantized / llama.cpp (within 1%)", "quantized / none (within 1%)", "none / llama.cpp"],
                         rows))
    path = write_json(args.out, {"args": args_dict(args), "cpu": machine.cpu_line(), "tokens": tokens,
                                 "bos": bos, "chunks": len(parts), "quantization_field": has_quantization_field(),
                                 "results": results})
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
