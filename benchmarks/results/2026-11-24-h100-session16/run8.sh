#!/bin/bash
# Device run 8 of session 16: the Gluon forward's deferred hand-back kept from the only Q buffer (D=128 causal
# with one Q buffer and 64-key tiles would have waited on itself): the Gluon forward's GPU tests, a new case
# among them.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 240 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k "hopper_forward or d256_short" > $OUT/gpu_tests_fwd_defer.log 2>&1
tail -n 1 $OUT/gpu_tests_fwd_defer.log
