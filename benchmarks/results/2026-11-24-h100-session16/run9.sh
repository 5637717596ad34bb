#!/bin/bash
# Device run 9 of session 16: the whole GPU suite on the session's last tree.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 480 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 > $OUT/gpu_tests_last.log 2>&1
tail -n 1 $OUT/gpu_tests_last.log
