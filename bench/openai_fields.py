"""The OpenAI fields of `flock serve` against `vllm serve`: the same requests, sent with the official `openai`
client to both (float32, the same HF folder, fresh servers one after the other), and how far the answers differ.

    python -m bench.openai_fields --vllm-venv V --model /work/models/smollm2-f32
    python -m bench.openai_fields --servers vllm --prompts 3          # one server: its answers' shapes only

Prompts: module docstrings of Python's standard library (bench/harness/stdlib_text.py), cut to
--min-tokens..--max-tokens tokens. Checks (each a markdown table; a server's HTTP error fails that check):
- echo: completions with token-id prompts, `echo, logprobs=5, max_tokens=1, temperature=0` (lm-eval's
  loglikelihood request): |token_logprobs diff| over the prompt positions, top-5 sets and top-1 agreement;
- chat: `logprobs, top_logprobs=5`, greedy, 16 tokens: same tokens, |diff| of the chosen and the top-5 logprobs;
- completion: text prompts, `logprobs=3`, greedy, 16 tokens: the same for the generated tokens;
- penalties: greedy, 48 tokens, presence / frequency / repetition penalties, logit_bias (+100, -100), min_tokens:
  the same text;
- n: `n=3`, temperature 0.8, a seed: 3 choices, usage.prompt_tokens counted once, and how many prompt tokens
  the server computed (Flock: /health step_tokens; vLLM: /metrics prompt tokens minus prefix-cache hits);
- stream: a streamed chat with logprobs: its chunks' logprobs joined equal the non-streamed ones.
Results and the raw responses: bench/out/openai_fields.json.
"""

import argparse
import json
import re
import sys
import time
from pathlib import Path

import httpx
import openai
import torch

from bench.harness import float32_servers as servers
from bench.harness import machine
from bench.harness.report import OUT, args_dict, markdown_table, write_json
from bench.harness.stdlib_text import module_docs

GEN = 16
PENALTIES = [{}, {"presence_penalty": 0.5}, {"presence_penalty": 2.0}, {"frequency_penalty": 0.5},
             {"frequency_penalty": 2.0}, {"repetition_penalty": 1.1}, {"repetition_penalty": 1.3},
             {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}]
QUESTION = "What is the capital of France?"


# -- prompts ---------------------------------------------------------------------------------------------------
def make_prompts(tokenizer, n: int, min_tokens: int, max_tokens: int) -> list[dict]:
    """Up to n docstrings (their first max_tokens tokens, cut back to the last whole line), each with its ids."""
    prompts = []
    for name, doc in module_docs():
        ids = tokenizer.encode(doc)[:max_tokens]
        text = tokenizer.decode(ids)
        if len(ids) == max_tokens and "\n" in text:
            text = text[:text.rindex("\n")]
        ids = tokenizer.encode(text)
        if len(ids) >= min_tokens:
            prompts.append({"name": name, "text": text, "ids": ids})
    return prompts[:n]


def chat_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": f"What does this documentation describe?\n\n{text}"}]


# -- requests --------------------------------------------------------------------------------------------------
def call(create, **kw) -> dict:
    """One request: the response as a dict, or {"error": ...} (an HTTP error fails the check, not the run)."""
    try:
        return create(**kw).model_dump()
    except openai.APIStatusError as e:
        return {"error": f"{e.status_code}: {_message(e)}"}
    except openai.APIError as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _message(e: openai.APIStatusError) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    return str(body.get("message") or body.get("error", {}).get("message") or e.message)[:200]


def stream_chat(client: openai.OpenAI, **kw) -> dict:
    """A streamed chat: its text and its chunks' logprobs content joined, as a non-streamed response has them."""
    try:
        text, content, reason = "", [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.delta.content or ""
                content += [t.model_dump() for t in (c.logprobs.content or [])] if c.logprobs else []
                reason = c.finish_reason or reason
        return {"choices": [{"message": {"content": text}, "logprobs": {"content": content}, "finish_reason": reason}]}
    except openai.APIStatusError as e:
        return {"error": f"{e.status_code}: {_message(e)}"}
    except openai.APIError as e:
        return {"error": f"{type(e).__name__}: {e}"}


def prompt_tokens_computed(server_name: str, url: str) -> float:
    """A running total of the prompt tokens the server computed (Flock: all tokens its steps computed)."""
    if server_name == "flock":
        return httpx.get(f"{url}/health", timeout=10).json()["step_tokens"]
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = lambda name: sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return total("vllm:prompt_tokens_total") - total("vllm:prefix_cache_hits_total")


def run_checks(server_name: str, url: str, prompts: list[dict], n_prompt: dict, tokenizer, args) -> dict:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=args.request_timeout)
    comp, chat = client.completions.create, client.chat.completions.create
    greedy = {"model": servers.NAME, "temperature": 0}
    r = {"echo": [call(comp, prompt=p["ids"], echo=True, logprobs=5, max_tokens=1, **greedy) for p in prompts]}
    chat_kw = [dict(messages=chat_messages(p["text"]), logprobs=True, top_logprobs=5, max_tokens=GEN, **greedy)
               for p in prompts]
    r["chat"] = [call(chat, **kw) for kw in chat_kw]
    r["completion"] = [call(comp, prompt=p["text"], logprobs=3, max_tokens=GEN, **greedy) for p in prompts]
    r["penalties"] = [call(comp, prompt=p["text"], max_tokens=48, **greedy, **openai_kw(s))
                      for s in PENALTIES for p in prompts[:args.penalty_prompts]]
    q = [{"role": "user", "content": QUESTION}]
    r["chat_settings"] = [call(chat, messages=q, **greedy, **openai_kw({"max_tokens": 24} | s))
                          for s in chat_settings(tokenizer)]
    before = prompt_tokens_computed(server_name, url)
    r["n"] = call(comp, prompt=n_prompt["ids"], n=3, temperature=0.8, seed=7, max_tokens=GEN, model=servers.NAME)
    r["n_computed"] = prompt_tokens_computed(server_name, url) - before
    r["stream"] = [stream_chat(client, **kw) for kw in chat_kw[:args.stream_prompts]]
    return r


def openai_kw(fields: dict) -> dict:
    """Request fields as the client takes them: vLLM's extensions (repetition_penalty, min_tokens) in extra_body."""
    extra = {k: v for k, v in fields.items() if k in ("repetition_penalty", "min_tokens")}
    return {k: v for k, v in fields.items() if k not in extra} | ({"extra_body": extra} if extra else {})


def chat_settings(tokenizer) -> list[dict]:
    up, down = tokenizer.encode(" Python")[0], tokenizer.encode("The")[0]
    return [{}, {"logit_bias": {str(up): 100}}, {"logit_bias": {str(down): -100}},
            {"logit_bias": {str(up): 5, str(down): -5}}, {"min_tokens": 16}, {"min_tokens": 16, "max_tokens": 16}]


# -- servers ---------------------------------------------------------------------------------------------------
def measure(name: str, prompts: list[dict], tokenizer, args) -> dict:
    t0 = time.perf_counter()
    server = servers.start(name, args, ("--enable-prompt-tokens-details",))
    ready_s = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        # the last prompt only for n: nothing before put it in the prefix cache
        r = run_checks(name, server.url, prompts[:-1], prompts[-1], tokenizer, args)
        if name == "flock":
            r["attention"] = httpx.get(f"{server.url}/health", timeout=10).json()["attention"]
    finally:
        server.stop()
    r |= {"ready_s": ready_s, "checks_s": time.perf_counter() - t1}
    print(f"{name}: ready after {ready_s:.0f} s, checks took {r['checks_s']:.0f} s", flush=True)
    return r


# -- comparisons -----------------------------------------------------------------------------------------------
def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}" if x and abs(x) < 1e-2 else f"{x:.3f}"


def max_or_none(xs) -> float | None:
    xs = list(xs)
    return max(xs) if xs else None


def top_compare(a: list[dict | None], b: list[dict | None]) -> tuple[float | None, float, float]:
    """Over positions with top logprobs on both: max |diff| of the shared entries, share of positions with
    the same set of tokens, with the same top-1."""
    pairs = [(x, y) for x, y in zip(a, b) if x and y]
    if not pairs:
        return None, 0.0, 0.0
    diff = max_or_none(abs(x[t] - y[t]) for x, y in pairs for t in x.keys() & y.keys())
    same_set = sum(set(x) == set(y) for x, y in pairs) / len(pairs)
    same_top = sum(max(x, key=x.get) == max(y, key=y.get) for x, y in pairs) / len(pairs)
    return diff, same_set, same_top


def error_of(rs: dict[str, dict]) -> str | None:
    """The servers' errors, if any, for one request's responses by server."""
    return "; ".join(f"{s}: {r['error']}" for s, r in rs.items() if "error" in r) or None


def responses(results: dict, check: str, i: int) -> dict[str, dict]:
    return {s: res[check][i] for s, res in results.items()}


def echo_rows(results: dict, prompts: list[dict]) -> tuple[list, list]:
    head = ["prompt", "tokens", f"shape ok ({' / '.join(results)})", "max abs diff token_logprobs", "top-5 same set",
            "top-1 same", "max abs diff top-5"]
    rows = []
    for i, p in enumerate(prompts):
        rs = responses(results, "echo", i)
        ok = " / ".join(echo_shape_ok(r, len(p["ids"])) for r in rs.values())
        if len(rs) < 2 or error_of(rs):
            rows.append([p["name"], len(p["ids"]), ok, error_of(rs) or "-", "-", "-", "-"])
            continue
        (la, lb) = (r["choices"][0]["logprobs"] for r in rs.values())
        n = len(p["ids"])
        diff = max_or_none(abs(x - y) for x, y in zip(la["token_logprobs"][1:n], lb["token_logprobs"][1:n]))
        tdiff, same_set, same_top = top_compare(la["top_logprobs"][1:n], lb["top_logprobs"][1:n])
        rows.append([p["name"], n, ok, fmt(diff), f"{same_set:.0%}", f"{same_top:.0%}", fmt(tdiff)])
    return head, rows


def echo_shape_ok(r: dict, n: int) -> str:
    """Echoed logprobs: n + 1 entries (the prompt and one generated token), the first one None."""
    if "error" in r:
        return r["error"][:60]
    lp = r["choices"][0]["logprobs"]
    ok = (len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n + 1
          and lp["token_logprobs"][0] is None and all(x is not None for x in lp["token_logprobs"][1:])
          and lp["text_offset"] == sorted(lp["text_offset"]) and all(len(t) >= 5 for t in lp["top_logprobs"][1:]))
    return "yes" if ok else "NO"


def chat_tokens(r: dict) -> tuple[list[str], list[float], list[dict]]:
    content = r["choices"][0]["logprobs"]["content"]
    return ([c["token"] for c in content], [c["logprob"] for c in content],
            [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content])


def completion_tokens(r: dict) -> tuple[list[str], list[float], list[dict]]:
    lp = r["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]


def generated_rows(results: dict, prompts: list[dict], check: str, k: int, tokens_of) -> tuple[list, list]:
    head = ["prompt", "same tokens", "max abs diff chosen", f"top-{k} same set", f"max abs diff top-{k}",
            *(f"{s} text" for s in results)]
    rows = []
    for i, p in enumerate(prompts):
        rs = responses(results, check, i)
        if len(rs) < 2 or error_of(rs):
            rows.append([p["name"], error_of(rs) or "-", "-", "-", "-", *(text_of(r)[:40] for r in rs.values())])
            continue
        (ta, la, tla), (tb, lb, tlb) = (tokens_of(r) for r in rs.values())
        same = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        diff = max_or_none(abs(x - y) for x, y in zip(la[:same], lb[:same]))
        tdiff, same_set, _ = top_compare(tla[:same + 1], tlb[:same + 1])
        rows.append([p["name"], f"{same}/{max(len(ta), len(tb))}", fmt(diff), f"{same_set:.0%}", fmt(tdiff),
                     *(text_of(r)[:40] for r in rs.values())])
    return head, rows


def text_of(r: dict) -> str:
    if "error" in r:
        return r["error"][:60]
    c = r["choices"][0]
    return json.dumps(c["text"] if "text" in c else c["message"]["content"]).replace("|", "\\|")


def same_text_rows(results: dict, labels: list[str], check: str) -> tuple[list, list]:
    head = ["setting", "same text", *results]
    rows = []
    for i, label in enumerate(labels):
        rs = responses(results, check, i)
        texts = [text_of(r) for r in rs.values()]
        same = "-" if len(rs) < 2 else error_of(rs) or ("yes" if texts[0] == texts[1] else "NO")
        rows.append([label, same, *(t[:50] for t in texts)])
    return head, rows


def n_rows(results: dict, n_prompt: dict) -> tuple[list, list]:
    head = ["server", "choices", "distinct texts", "usage.prompt_tokens", "cached_tokens", "prompt tokens computed"]
    rows = []
    for s, res in results.items():
        r = res["n"]
        if "error" in r:
            rows.append([s, r["error"], "-", "-", "-", "-"])
            continue
        usage, choices = r["usage"], r["choices"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        computed = res["n_computed"]
        if s == "flock":  # its steps' tokens also count each decode input: completion_tokens - n of them
            computed -= usage["completion_tokens"] - len(choices)
        rows.append([s, f"{len(choices)} (indices {sorted(c['index'] for c in choices)})",
                     len({c["text"] for c in choices}), f"{usage['prompt_tokens']} (prompt: {len(n_prompt['ids'])})",
                     cached, f"{computed:.0f} (3 x prompt: {3 * len(n_prompt['ids'])})"])
    return head, rows


def stream_rows(results: dict) -> tuple[list, list]:
    head = ["server", "prompt", "same tokens as non-streamed", "max abs diff logprob", "max abs diff top-5"]
    rows = []
    for s, res in results.items():
        for i, r in enumerate(res["stream"]):
            ref = res["chat"][i]
            if err := error_of({"streamed": r, "non-streamed": ref}):
                rows.append([s, i, err, "-", "-"])
                continue
            (ta, la, tla), (tb, lb, tlb) = chat_tokens(r), chat_tokens(ref)
            tdiff, _, _ = top_compare(tla, tlb)
            rows.append([s, i, "yes" if ta == tb else "NO", fmt(max_or_none(abs(x - y) for x, y in zip(la, lb))),
                         fmt(tdiff)])
    return head, rows


def report(results: dict, prompts: list[dict], n_prompt: dict, tokenizer, args) -> None:
    sections = [
        ("echo=True, logprobs=5, max_tokens=1, token-id prompts (lm-eval's loglikelihood request)",
         echo_rows(results, prompts)),
        (f"chat, logprobs=True, top_logprobs=5, greedy, {GEN} tokens",
         generated_rows(results, prompts, "chat", 5, chat_tokens)),
        (f"completions, logprobs=3, greedy, {GEN} tokens", generated_rows(results, prompts, "completion", 3,
                                                                           completion_tokens)),
        ("completions, greedy, 48 tokens, penalties",
         same_text_rows(results, [f"{p['name']} {json.dumps(s)}" for s in PENALTIES
                                  for p in prompts[:args.penalty_prompts]], "penalties")),
        (f"chat {QUESTION!r}, greedy, logit_bias and min_tokens",
         same_text_rows(results, [json.dumps(s) for s in chat_settings(tokenizer)], "chat_settings")),
        (f"n=3, temperature 0.8, seed 7, {GEN} tokens, a fresh prompt", n_rows(results, n_prompt)),
        ("streamed chat with logprobs vs the same request non-streamed", stream_rows(results)),
    ]
    for title, (head, rows) in sections:
        print(f"\n### {title}\n" + markdown_table(head, rows))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.openai_fields", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    servers.add_args(ap)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--min-tokens", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--penalty-prompts", type=int, default=3, help="prompts per penalty setting")
    ap.add_argument("--stream-prompts", type=int, default=3)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--output", type=Path, default=OUT / "openai_fields.json")
    args = ap.parse_args()
    servers.resolve(args)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = make_prompts(tokenizer, args.prompts + 1, args.min_tokens, args.max_tokens)  # the last one for n
    print(machine.header("openai_fields", dtype=torch.float32), flush=True)
    print(f"# {args.model}; {len(prompts) - 1} prompts of {min(len(p['ids']) for p in prompts)}-"
          f"{max(len(p['ids']) for p in prompts)} tokens (stdlib docstrings)", flush=True)
    results = {name: measure(name, prompts, tokenizer, args) for name in args.servers}
    if "flock" in results:
        print(f"# flock serve attention: {results['flock']['attention']}")
    report(results, prompts[:-1], prompts[-1], tokenizer, args)
    path = write_json(args.output, {"cpu": machine.cpu_model(), "kernel_paths": machine.kernel_paths(torch.float32),
                                    "args": args_dict(args), "prompts": prompts, "results": results})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
