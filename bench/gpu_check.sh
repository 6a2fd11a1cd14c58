#!/usr/bin/env bash
# Flock on a CUDA machine (about 5 minutes); every step runs, the exit status says whether any failed:
#   1. tests/attention/test_triton.py with the kernels compiled (TRITON_INTERPRET unset: the tests run on cuda);
#   2. tests/engine/test_cuda.py: the engine on cuda gives the transformers reference's greedy tokens (float64 with
#      the torch backends, float32 with the Triton kernel under fcfs, batchllm and feather);
#   3. decode-step attention time of "torch", "torch-cascade" and "triton" (python -m bench.triton_decode) at sharing
#      degree 16: 64 groups x 16 requests, 2,048-token shared prefix, ~64 own tokens each, bf16;
#   4. the whole engine on cuda (python -m bench.engine_speed --skip-vllm): bench-mid, shared and unshared, attention
#      "auto" (triton), then the shared batch with torch-cascade.
# Installs nothing unless the test dependencies are missing (then `pip install -e '.[test]'`).
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
if ! python -c "import pytest, triton, flock, safetensors, tokenizers, transformers, xxhash" 2>/dev/null; then
    python -m pip install -q -e '.[test]'
fi
python -c "import triton, transformers; print('triton', triton.__version__, 'transformers', transformers.__version__)"

failed=()
step() { echo "== $*"; "$@" || failed+=("$*"); }
step timeout 200 python -m pytest tests/attention/test_triton.py -q -p no:cacheprovider
step timeout 120 python -m pytest tests/engine/test_cuda.py -q -p no:cacheprovider
step timeout 90 python -m bench.triton_decode "$@"
out=$(mktemp -d)
step timeout 120 python -m bench.engine_speed --model mid --workload shared,unshared --skip-vllm --out "$out"
step timeout 90 python -m bench.engine_speed --model mid --workload shared --attention torch-cascade --skip-vllm --out "$out"
if ((${#failed[@]})); then printf 'FAILED: %s\n' "${failed[@]}"; exit 1; fi
echo "all steps passed"
