#!/bin/bash
# Device run 4 of session 15 (the kernels as committed; the bench times the device only now): the new
# bench-timing test, then the whole GPU suite.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/gpu.txt
timeout 60 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -k bench_times 2>&1 | tail -n 2
timeout 420 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 > $OUT/gpu_tests_full.log 2>&1
tail -n 1 $OUT/gpu_tests_full.log
