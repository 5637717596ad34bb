#!/usr/bin/env bash
# On a GPU machine, from the source tree: the GPU test suite, then a quick side-by-side timing
# against torch SDPA. Results go to $OUT (or ./gpu-results). Usage: scripts/gpu_check.sh [bench args]
set -o pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())" | tee -a "$out/device.txt"
# Compiling the kernel variants dominates: spread the tests over processes when pytest-xdist is there,
# the tests that compile the same kernels on one process (tests/conftest.py: kernel_group).
parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n auto --dist loadgroup")
python3 -m pytest tests -m gpu -q $parallel -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -n 15
tests=$?
python3 -m cuflash.bench --quick --out "$out" "$@" 2>&1 | tee "$out/bench.log" | tail -n 30
exit $tests
