"""`flock serve` and `vllm serve` on the same float32 folder, for benchmarks that send both the same requests."""

import argparse
import shlex
from pathlib import Path

from bench.harness import vllm
from bench.harness.offline import hf_folder
from bench.harness.report import OUT
from bench.harness.server_process import ServerProcess

NAME = "model"  # the served model name on both servers


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="flock/smollm2", help="a Hugging Face folder (or a built-in, saved as float32)")
    ap.add_argument("--servers", nargs="+", default=["vllm", "flock"], choices=["vllm", "flock"])
    ap.add_argument("--vllm-venv", type=Path, default=vllm.DEFAULT_VENV, help="an existing vLLM venv")
    ap.add_argument("--flock-args", default="", help="extra `flock serve` options")
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` options")
    ap.add_argument("--ready-timeout", type=float, default=600)


def resolve(args: argparse.Namespace) -> None:
    """The model as a float32 folder both servers load, and vLLM's python."""
    args.model = str(hf_folder(args.model, OUT, dtype="float32"))
    if "vllm" in args.servers:
        args.vllm_python = vllm.existing_python(args.vllm_venv.resolve())


def start(name: str, args: argparse.Namespace, vllm_flags: tuple[str, ...] = ()):
    """The started server `name` ("flock" or "vllm"), float32, serving the model as NAME."""
    if name == "flock":
        return ServerProcess("--model", args.model, "--dtype", "float32", "--served-model-name", NAME,
                             *shlex.split(args.flock_args), ready_timeout=args.ready_timeout).start()
    return vllm.VLLMServer(args.vllm_python, args.model, ["--dtype", "float32", "--served-model-name", NAME,
                                                          *vllm_flags, *shlex.split(args.vllm_args)],
                           args.ready_timeout)
