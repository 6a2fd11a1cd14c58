#!/usr/bin/env bash
# The Triton attention backend on a CUDA machine (under 5 minutes):
#   1. tests/attention/test_triton.py with the kernels compiled (TRITON_INTERPRET unset: the tests run on cuda);
#   2. decode-step attention time of "torch", "torch-cascade" and "triton" (python -m bench.triton_decode) at sharing
#      degree 16: 64 groups x 16 requests, 2,048-token shared prefix, ~64 own tokens each, bf16.
# Installs nothing unless the test dependencies are missing (then `pip install -e '.[test]'`).
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
if ! python -c "import pytest, triton, flock, safetensors, tokenizers, transformers, xxhash" 2>/dev/null; then
    python -m pip install -q -e '.[test]'
fi
python -c "import triton; print('triton', triton.__version__)"

timeout 200 python -m pytest tests/attention/test_triton.py -q -p no:cacheprovider
timeout 90 python -m bench.triton_decode "$@"
