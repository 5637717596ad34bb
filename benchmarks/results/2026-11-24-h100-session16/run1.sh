#!/bin/bash
# Device run 1 of session 16 (2026-11-24): the Triton kernels' banded launch order (heaviest tiles first across groups of
# heads sized to the L2) against the order before, then the GPU tests that reach the Triton kernels.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/gpu.txt
timeout 250 python3 $(dirname $0)/ab_order.py 2>&1 | tee $OUT/ab_order.log
timeout 320 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 \
  -k "oracle or gqa or varlen or d256 or length_one or dropout or mask or window or variant or methods" > $OUT/gpu_tests_order.log 2>&1
tail -n 3 $OUT/gpu_tests_order.log
