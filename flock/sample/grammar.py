"""Structured outputs with xgrammar: grammars compiled once per distinct spec, a matcher per request, and the
token bitmasks that keep each constrained row of logits inside its grammar.

The engine compiles (`GrammarCompiler.matcher`, which rejects a bad schema before the request is queued) and
advances each request's matcher by its sampled token; the runner fills the bitmasks of the step's constrained
rows on a side thread while the model runs (`GrammarMasks.fill`) and applies them to the logits before
sampling (`GrammarMasks.apply`). Recompute preemption keeps a request's output tokens, so its matcher stays
where it is."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from flock.model import fused_ops
from flock.sample.json_schema import enforceable
from flock.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# compiled grammars kept, least recently used out first: 0.2-1.2 MB each (their token masks grow with the vocabulary)
MAX_CACHED_GRAMMARS = 512


def _xgrammar():
    import xgrammar  # imported on the first structured request: it costs ~0.5 s of start-up

    return xgrammar


def _canonical(schema, properties: bool = False):
    """A JSON schema with every object's keys sorted but those of a `properties` map, whose order the output's
    keys follow (two schemas that differ only there compile apart)."""
    if isinstance(schema, dict):
        items = schema.items() if properties else sorted(schema.items())
        return {k: _canonical(v, not properties and k == "properties") for k, v in items}
    if isinstance(schema, list):
        return [_canonical(v) for v in schema]
    return schema


def rejection(e: Exception) -> str:
    """Why xgrammar (or Flock's own check of a schema) rejected a spec, without the C++ source position xgrammar's
    messages start with."""
    return re.sub(r"^.*?\.cc:\d+:\s*", "", str(e).strip().rsplit("] ", 1)[-1])


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer, each distinct spec once."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], any_whitespace: bool = False):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.any_whitespace = any_whitespace  # for a spec that does not say (its disable_any_whitespace None)
        self._compiler = None
        self.cache: OrderedDict[tuple, xgrammar.CompiledGrammar] = OrderedDict()  # least recently used first

    def matcher(self, spec: StructuredOutputsParams) -> xgrammar.GrammarMatcher:
        """A fresh matcher at the start of the spec's grammar; ValueError naming the field when xgrammar rejects
        the spec."""
        return _xgrammar().GrammarMatcher(self.compile(spec))

    def compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        spec.validate()
        key = self._key(spec)
        grammar = self.cache.get(key)
        if grammar is not None:
            try:
                self.cache.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile
                pass
        else:
            try:
                prepared = replace(spec, json=enforceable(spec.json)) if spec.kind == "json" else spec
                grammar = self._compile(prepared, key[-1])
            except (RuntimeError, ValueError, TypeError) as e:
                raise ValueError(f"structured_outputs.{spec.kind} was rejected by the grammar engine: "
                                 f"{rejection(e)}") from None
            self.cache[key] = grammar
            while len(self.cache) > MAX_CACHED_GRAMMARS:  # live matchers keep their own reference
                self.cache.popitem(last=False)
        return grammar

    def _key(self, spec: StructuredOutputsParams) -> tuple:
        value = getattr(spec, spec.kind)
        if spec.kind == "json" and isinstance(value, dict):
            value = json.dumps(_canonical(value))
        elif spec.kind == "choice":
            value = tuple(value)
        if spec.disable_any_whitespace is None:
            layout = "any" if self.any_whitespace else "spaced"
        else:
            layout = "compact" if spec.disable_any_whitespace else "any"
        return spec.kind, value, spec.after, layout

    def _compile(self, spec: StructuredOutputsParams, layout: str) -> xgrammar.CompiledGrammar:
        xgr = _xgrammar()
        grammar = _grammar(xgr, spec, layout)
        if spec.after is not None:  # free text up to it first
            free = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": spec.after}
            grammar = xgr.Grammar.concat(
                xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": free})), grammar)
        return self._xgr_compiler().compile_grammar(grammar)

    def _xgr_compiler(self):
        if self._compiler is None:
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # its own cache has no bound; ours has
        return self._compiler


def _grammar(xgr, spec: StructuredOutputsParams, layout: str) -> xgrammar.Grammar:
    """The spec's grammar; JSON's `layout`: "any" whitespace, "spaced" (none but after its commas and colons, as
    json.dumps writes it) or "compact" (none at all: vLLM's disable_any_whitespace)."""
    if spec.kind in ("json", "json_object"):
        schema = spec.json if spec.kind == "json" else {"type": "object"}
        return xgr.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                            any_whitespace=layout == "any", strict_mode=spec.kind == "json",
                                            separators=(",", ":") if layout == "compact" else None)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.regex)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in spec.choice))
    if spec.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(_structural_tag(spec.structural_tag))
    return xgr.Grammar.from_lark(spec.grammar) if is_lark(spec.grammar) else xgr.Grammar.from_ebnf(spec.grammar)


def is_lark(grammar: str) -> bool:
    """Whether a grammar is in Lark's syntax rather than EBNF (GBNF): no `::=` rule outside comments, as vLLM
    tells them apart."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.splitlines())


def _structural_tag(text: str) -> str:
    """xgrammar's structural tag JSON; vLLM's earlier form ({"structures": [{begin, schema, end}], "triggers"})
    converted to it."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError:
        return text  # xgrammar reports it
    if not isinstance(tag, dict) or "structures" not in tag:
        return text
    xgr = _xgrammar()
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"]) for s in tag["structures"]]
    return xgr.StructuralTag.from_legacy_structural_tag(items, tag.get("triggers", [])).model_dump_json()


def drafts_in_grammar(matcher: xgrammar.GrammarMatcher, drafts: list[int], limit: int) -> list[int]:
    """Drafts for a constrained request: the tokens its grammar forces next (jump-forward), else `drafts`; at
    most `limit`, up to the first the grammar refuses or that would end it. The matcher is left as it was."""
    candidates = (matcher.find_jump_forward_tokens() if limit > 0 else [])[:limit] or drafts
    kept = 0
    for token in candidates:
        if not matcher.accept_token(token):
            break
        if matcher.is_terminated():
            matcher.rollback(1)
            break
        kept += 1
    if kept:
        matcher.rollback(kept)
    return candidates[:kept]


def _bit(k: int) -> int:
    """Bit k of an int32 bitmask word, as the int32 value that has it alone."""
    return 1 << k if k < 31 else -(1 << 31)


class GrammarMasks:
    """The token bitmasks of a step's constrained rows, filled on a side thread while the model runs."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.bitmask: torch.Tensor | None = None  # int32 rows of ceil(vocab / 32) words, grown as needed
        self.pool: ThreadPoolExecutor | None = None
        self.batch = None

    def fill(self, rows: list[tuple[xgrammar.GrammarMatcher, list[int], Sequence[int]]]) -> Future | None:
        """Start filling one bitmask row per constrained row (in order): its matcher, the drafts before the row (a
        request's rows follow each other, each with one draft more) and tokens the row allows whatever its grammar
        says; None when there is none."""
        if not rows:
            return None
        xgr = _xgrammar()
        if self.bitmask is None or len(self.bitmask) < len(rows):
            self.bitmask = xgr.allocate_token_bitmask(max(len(rows), 64), self.vocab_size)
            self.pool = self.pool or ThreadPoolExecutor(1, thread_name_prefix="flock-grammar")
            self.batch = self.batch or xgr.BatchGrammarMatcher()
        return self.pool.submit(self._fill, rows, self.bitmask[: len(rows)])

    def _fill(self, rows: list[tuple[xgrammar.GrammarMatcher, list[int], Sequence[int]]], bitmask: torch.Tensor
              ) -> None:
        """Rows of requests without drafts in one batch call; a request with drafts row by row, its matcher
        advanced by a draft between rows and rolled back after its last; then each row's tokens allowed anyway."""
        last = [i + 1 == len(rows) or not rows[i + 1][1] for i in range(len(rows))]  # a request's last row
        alone = [i for i, (_, drafts, _) in enumerate(rows) if not drafts and last[i]]
        if alone:
            self.batch.batch_fill_next_token_bitmask([rows[i][0] for i in alone], bitmask, alone)
        for i, (matcher, drafts, _) in enumerate(rows):
            if drafts or not last[i]:
                if drafts:
                    matcher.accept_token(drafts[-1])
                matcher.fill_next_token_bitmask(bitmask, i)
                if last[i]:
                    matcher.rollback(len(drafts))
        with torch.inference_mode():  # the bitmask is the runner's (an inference tensor); this thread is not
            for i, (_, _, allowed) in enumerate(rows):
                for token in allowed:
                    if token < self.vocab_size:
                        bitmask[i, token // 32] |= _bit(token % 32)

    def apply(self, logits: torch.Tensor, rows: list[int], filled: Future) -> None:
        """Mask logits rows `rows` (in place) with the bitmask rows `filled` has made, in the same order."""
        filled.result()
        bitmask, index = self.bitmask[: len(rows)], torch.tensor(rows, dtype=torch.long, device=logits.device)
        if fused_ops.unavailable(logits.dtype, logits.device) is None and logits.stride(1) == 1:
            fused_ops.apply_bitmask(logits, bitmask, index)
            return
        bits = bitmask.to(logits.device)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
