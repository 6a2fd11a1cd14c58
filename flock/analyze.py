"""`flock analyze FILE`: read a batch, plan its prefix sharing (BatchLLM), report groups and saving rates.

Accepted JSONL lines: OpenAI Batch requests (`body.prompt` for /v1/completions, `body.messages` for
/v1/chat/completions, formatted with the tokenizer's chat template), `{"prompt": "..." | [ids]}`,
`{"messages": [...]}` and `{"prompt_token_ids": [...]}`. Bad lines are reported (with their line number) on
stderr and the rest is analysed; the exit status is then 1. An empty file is an error (status 2).
"""

from __future__ import annotations

import json
import sys

__all__ = ["read_batch", "analyze_file", "format_plan", "plot_plan"]


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)


def _classify(item) -> tuple[str, object]:
    """('ids' | 'text' | 'messages', payload) or raise ValueError with the reason."""
    if not isinstance(item, dict):
        raise ValueError(f"expected a JSON object, got {type(item).__name__}")
    if "prompt_token_ids" in item:
        if not _is_ids(item["prompt_token_ids"]):
            raise ValueError("'prompt_token_ids' must be a list of non-negative integers")
        return "ids", item["prompt_token_ids"]
    body = item.get("body", item)
    if not isinstance(body, dict):
        raise ValueError("'body' must be a JSON object")
    if "prompt" in body:
        p = body["prompt"]
        if isinstance(p, str):
            return "text", p
        if _is_ids(p):
            return "ids", p
        raise ValueError("'prompt' must be a string or a list of token ids")
    if "messages" in body:
        m = body["messages"]
        if not (isinstance(m, list) and m and all(isinstance(x, dict) and "role" in x for x in m)):
            raise ValueError("'messages' must be a non-empty list of {'role', 'content'} objects")
        return "messages", m
    raise ValueError("needs 'prompt', 'messages' or 'prompt_token_ids' (directly or in 'body')")


def read_batch(path: str, model: str = "flock/tiny") -> tuple[list[int], list[list[int]], list[str], int]:
    """(line numbers, token ids, error messages, number of non-blank lines) of a JSONL batch.
    The tokenizer is loaded only when some line holds text or messages."""
    numbers, kinds, errors = [], [], []
    nonblank = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            nonblank += 1
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                errors.append((number, f"not valid JSON ({e.msg})"))
                continue
            try:
                kinds.append(_classify(item))
                numbers.append(number)
            except ValueError as e:
                errors.append((number, str(e)))
    ids: list = [p if k == "ids" else None for k, p in kinds]
    if any(k != "ids" for k, _ in kinds):
        tok = _tokenizer(model)
        text_at = [i for i, (k, _) in enumerate(kinds) if k == "text"]
        if text_at:
            encoded = tok([kinds[i][1] for i in text_at], add_special_tokens=True)["input_ids"]
            for i, e in zip(text_at, encoded):
                ids[i] = list(e)
        for i, (k, messages) in enumerate(kinds):
            if k != "messages":
                continue
            try:
                out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
                ids[i] = list(out["input_ids"] if hasattr(out, "keys") else out)
            except Exception as e:  # a template can reject any message list; report the line, go on
                errors.append((numbers[i], f"chat template failed ({type(e).__name__}: {e})"))
    keep = [i for i, x in enumerate(ids) if x is not None]
    messages = [f"{path}:{number}: {why}" for number, why in sorted(errors)]
    return [numbers[i] for i in keep], [ids[i] for i in keep], messages, nonblank


def _tokenizer(model: str):
    from flock.model import resolve_model
    from flock.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(model).folder)


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
