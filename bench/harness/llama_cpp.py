"""llama.cpp's own tools, built from source (shared/notes/peers.md): the converter and llama-quantize that make
GGUF files, llama-bench (single-stream decode), llama-server (parallel slots, driven by concurrent requests)
and llama-perplexity. `LlamaCpp.find(DIR)` checks that the binaries are there and says how to build them."""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness.server_process import free_port, wait_healthy

__all__ = ["DEFAULT_TREE", "TOOLS", "LlamaCpp", "LlamaServer", "add_argument", "find_or_exit", "send_prompts", "file_type"]

DEFAULT_TREE = Path("/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp")
TOOLS = ("llama-server", "llama-bench", "llama-quantize", "llama-perplexity")
BUILD_HINT = (
    "build it from the llama-cpp-python sdist (shared/notes/peers.md):\n"
    "  pip download --no-deps --no-binary :all: llama-cpp-python -d D   # the tree is D/.../vendor/llama.cpp\n"
    "  cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF\n"
    f"  cmake --build build -j2 --target {' '.join(TOOLS)}\n"
    "(on a Xeon whose AMX path dies with SIGILL add -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF and "
    "the AVX flags peers.md lists)")
FLOAT_FILE_TYPES = {0, 1, 32}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_BF16


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llama-cpp", type=Path, default=DEFAULT_TREE,
                        help="llama.cpp source tree with its binaries under build/bin (default: %(default)s)")


def find_or_exit(tree: Path | str = DEFAULT_TREE) -> "LlamaCpp":
    """`LlamaCpp.find(tree)`, or the script ends with the message saying how to build llama.cpp."""
    try:
        return LlamaCpp.find(tree)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None


def file_type(gguf: Path) -> int | None:
    """general.file_type of a GGUF file (llama_ftype: 0 F32, 1 F16, 7 Q8_0, 15 Q4_K_M, 32 BF16, ...)."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get("general.file_type")
    return None if field is None else int(field.parts[field.data[0]][0])


def _run(cmd: list, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` (llama.cpp logs to stderr, results go to stdout); raises with the output's tail on failure."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        raise RuntimeError(f"{Path(str(cmd[0])).name} exited with {proc.returncode}:\n{out[-3000:]}")
    return proc


@dataclass(frozen=True)
class LlamaCpp:
    tree: Path

    @classmethod
    def find(cls, tree: Path | str = DEFAULT_TREE) -> "LlamaCpp":
        """The tree, once every tool in TOOLS and the converter are there; otherwise FileNotFoundError saying
        what is missing and how to build it."""
        tools = cls(Path(tree).resolve())
        missing = [t for t in TOOLS if not (tools.bin / t).is_file()]
        if not tools.converter.is_file():
            missing.append("convert_hf_to_gguf.py")
        if missing:
            raise FileNotFoundError(f"llama.cpp at {tools.tree} lacks {', '.join(missing)}; {BUILD_HINT}")
        return tools

    @property
    def bin(self) -> Path:
        return self.tree / "build" / "bin"

    @property
    def converter(self) -> Path:
        return self.tree / "convert_hf_to_gguf.py"

    def tool(self, name: str) -> Path:
        return self.bin / name

    # -- files ---------------------------------------------------------------------------------------------------
    def convert(self, hf_folder: Path, out: Path, outtype: str = "f16") -> Path:
        """A GGUF file of an HF folder (convert_hf_to_gguf.py, with the tree's own gguf-py)."""
        if importlib.util.find_spec("sentencepiece") is None:  # a Llama vocabulary's first try imports it
            raise ModuleNotFoundError("llama.cpp's convert_hf_to_gguf.py needs sentencepiece: "
                                      "pip install sentencepiece")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(self.tree / "gguf-py"),
                                                                            os.environ.get("PYTHONPATH")]))}
        _run([sys.executable, self.converter, hf_folder, "--outfile", out, "--outtype", outtype], env=env)
        return out

    def quantize(self, src: Path, dst: Path, kind: str, threads: int = 2) -> Path:
        """`kind` (Q8_0, Q4_K_M, ...) of `src` by llama-quantize; --allow-requantize where `src` is already
        quantized."""
        requantize = ["--allow-requantize"] if file_type(src) not in FLOAT_FILE_TYPES else []
        _run([self.tool("llama-quantize"), *requantize, src, dst, kind, threads])
        return dst

    # -- measurements --------------------------------------------------------------------------------------------
    def bench_decode(self, gguf: Path, threads: int, n: int, repetitions: int = 5) -> dict:
        """llama-bench's text generation test (-p 0 -n N): tokens/s, mean, standard deviation and best over the
        repetitions, decoding from an empty context after its warm-up run."""
        out = _run([self.tool("llama-bench"), "-m", gguf, "-p", 0, "-n", n, "-t", threads, "-r", repetitions,
                    "-o", "json"]).stdout
        runs = json.loads(out[out.index("["):out.rindex("]") + 1])
        run = next(r for r in runs if r.get("n_gen") == n and not r.get("n_prompt"))
        return {"tokens_per_s": run["avg_ts"], "stddev_tokens_per_s": run["stddev_ts"], "n_gen": n,
                "best_tokens_per_s": max(run.get("samples_ts") or [run["avg_ts"]]),
                "threads": run.get("n_threads", threads), "repetitions": repetitions,
                "backend": run.get("backends"), "cpu": run.get("cpu_info"), "build": run.get("build_commit")}

    def perplexity(self, gguf: Path, text_file: Path, ctx: int = 512, threads: int = 2) -> dict:
        """llama-perplexity's final estimate over `text_file` in chunks of `ctx` tokens (it scores the second
        half of each chunk), and the number of chunks it used."""
        proc = _run([self.tool("llama-perplexity"), "-m", gguf, "-f", text_file, "-c", ctx, "-t", threads])
        out = proc.stdout + proc.stderr
        final = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out)
        chunks = re.search(r"calculating perplexity over (\d+) chunks", out)
        if final is None or chunks is None:
            raise RuntimeError(f"no final estimate in llama-perplexity's output:\n{out[-3000:]}")
        return {"ppl": float(final[1]), "ppl_error": float(final[2]), "chunks": int(chunks[1]), "ctx": ctx}

    def server(self, gguf: Path, threads: int, slots: int, ctx: int, *extra: str) -> "LlamaServer":
        return LlamaServer(self.tool("llama-server"), gguf, threads, slots, ctx, list(extra))


class LlamaServer:
    """llama-server on a free loopback port: `-np SLOTS` parallel slots of `ctx` tokens each (-c CTX*SLOTS),
    `-t` threads; ready when /health answers 200 (it answers 503 while the model loads)."""

    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int, ctx: int, extra: list[str],
                 ready_timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                    "-c", str(ctx * slots), "--host", "127.0.0.1", "--port", str(self.port), *extra]
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)

    def __enter__(self) -> "LlamaServer":
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        if wait_healthy(self.proc, self.url, self.ready_timeout, "llama-server", lambda: self.logs()[-3000:]):
            return self
        self.__exit__()
        raise RuntimeError(f"llama-server was not ready within {self.ready_timeout} s:\n{self.logs()[-3000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(encoding="utf-8", errors="replace")

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """llama.cpp's own token ids of `text` (its /tokenize endpoint; add_special: BOS where the vocabulary
        adds one); special-token text stays plain text, as llama-perplexity tokenizes its file."""
        body = {"content": text, "add_special": add_special, "parse_special": False}
        r = httpx.post(f"{self.url}/tokenize", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["tokens"]

    def complete(self, prompt: list[int], n_predict: int, client: httpx.Client | None = None) -> dict:
        """One greedy /completion of token ids, `n_predict` tokens exactly (ignore_eos), prompt cache on."""
        body = {"prompt": prompt, "n_predict": n_predict, "cache_prompt": True, "temperature": 0,
                "ignore_eos": True}
        r = (client or httpx).post(f"{self.url}/completion", json=body, timeout=3600)
        r.raise_for_status()
        return r.json()


def send_prompts(server: LlamaServer, prompts: list[list[int]], n_predict: int, concurrency: int) -> dict:
    """`prompts` sent from `concurrency` threads at once (each its own connection); wall seconds from the
    first send to the last answer, tokens generated, and the server's own prompt / cached token counts."""
    def one(prompt: list[int]) -> dict:
        with httpx.Client() as client:
            return server.complete(prompt, n_predict, client)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    timings = [a.get("timings", {}) for a in answers]
    return {"wall_s": wall, "generated_tokens": sum(a["tokens_predicted"] for a in answers),
            "prompt_tokens": sum(map(len, prompts)),
            "computed_prompt_tokens": sum(t.get("prompt_n", 0) for t in timings),
            "cached_prompt_tokens": sum(t.get("cache_n", 0) for t in timings)}
