#!/bin/bash
# Device run 12 of session 14: the deferred release at D=128 causal only (non-causal D=128 and all of
# D=64 instruction for instruction the last commit's SASS, checked offline: the non-causal rows time
# the same code twice) against the last commit's forward (src/cuflash/kernels/_hf_base.py, a copy
# made for the run), two rounds; the forward's GPU tests.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 250 python benchmarks/results/2026-11-23-h100-fwd-max/ab_fwd.py 128 512,1024,2048,4096,16384 2 > $OUT/ab_fwd_release_causal.log 2>&1
timeout 200 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k "hopper_forward or hopper_short or route or causal" > $OUT/gpu_tests_release_causal.log 2>&1
tail -n 1 $OUT/gpu_tests_release_causal.log
cat $OUT/ab_fwd_release_causal.log
