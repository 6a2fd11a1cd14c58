"""What structured outputs add to a decode step: xgrammar's bitmask fill (on the side thread, so it overlaps the
forward pass) and the mask applied to the logits (Flock's fused kernel, against xgrammar's own CPU kernel), at
64 and 256 constrained rows of SmolLM2's vocabulary, beside the decode step they join.

    python -m bench.grammar_masks [--rows 64 256] [--model flock/smollm2]

Matchers sit mid-JSON (inside a string value of a 6-field schema, the state a long extraction spends most steps
in) and at the schema's start. The decode step is the engine's own: `rows` prompts of 64 tokens, the mean wall time of 8 decode steps
(forward pass, logits, sampling, no grammar).
"""

import argparse
import time

import torch

from bench.harness import machine
from bench.harness.report import markdown_table
from bench.harness.timing import median_time
from flock import LLM, SamplingParams, StructuredOutputsParams
from flock.model import fused_ops

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["title", "kind", "year", "tags", "authors", "ok"],
          "properties": {"title": {"type": "string"}, "kind": {"enum": ["guide", "reference", "howto"]},
                         "year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
                         "authors": {"type": "array", "items": {"type": "object", "required": ["name"],
                                                                "properties": {"name": {"type": "string"}}}},
                         "ok": {"type": "boolean"}}}
STATES = {"start": "", "mid-string": '{"title": "The standard library\'s json mod'}


def decode_step_seconds(llm: LLM, rows: int, steps: int = 8) -> float:
    """Mean wall seconds of the engine's decode steps with `rows` running requests (their prefill done first)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    reqs = [engine.add_request([100 + (i * 7 + j) % 30000 for j in range(64)], params) for i in range(rows)]
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - t0) / steps
    while engine.has_unfinished():
        engine.step()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="flock/smollm2")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import xgrammar as xgr

    llm = LLM(args.model, num_kv_blocks=4096, max_num_seqs=max(args.rows))
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    print(machine.header("grammar_masks", dtype=engine.runner.dtype))
    grammar = engine.grammars.compile(StructuredOutputsParams(json=SCHEMA))
    batch = xgr.BatchGrammarMatcher()
    table = []
    for rows in args.rows:
        step = decode_step_seconds(llm, rows)
        logits = torch.randn(rows, vocab)
        index = torch.arange(rows)
        for state, prefix in STATES.items():
            matchers = [xgr.GrammarMatcher(grammar) for _ in range(rows)]
            for m in matchers:
                assert m.accept_string(prefix) or not prefix
            bitmask = xgr.allocate_token_bitmask(rows, vocab)
            fill = median_time(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask), args.repeats)
            fused = median_time(lambda: fused_ops.apply_bitmask(logits, bitmask, index), args.repeats)
            theirs = median_time(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask), args.repeats)
            table.append([rows, state, f"{step * 1e3:.1f}", f"{fill * 1e3:.2f}", f"{fused * 1e3:.2f}",
                          f"{theirs * 1e3:.2f}", f"{fused / step:.1%}"])
    print(markdown_table(["rows", "matcher state", "decode step ms", "fill ms (side thread)", "apply ms (fused)",
                          "apply ms (xgrammar CPU)", "apply / step"], table))


if __name__ == "__main__":
    main()
