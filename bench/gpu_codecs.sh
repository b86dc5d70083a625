#!/usr/bin/env bash
# Codec throughput on a lent GPU (H200) and the hook on CUDA, in one call of a few minutes:
#   bash bench/gpu_codecs.sh              # on the GPU machine; results under $OUT (or bench/results/gpu)
#   bash bench/gpu_codecs.sh --dry-run    # CPU smoke test of the same path
# The GPU machine has no network: torch with CUDA (and Triton, for the compiled path) must be there;
# netgain itself needs nothing else for this (numpy, tqdm are not imported by the comm path).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR=${OUT:-bench/results/gpu}
timeout 420 "$PYTHON" bench/gpu_codecs.py --out "$OUT_DIR" "$@"
