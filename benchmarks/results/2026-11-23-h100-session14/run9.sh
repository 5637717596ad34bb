#!/bin/bash
# Device run 9 of session 14: O's buffer handed back after the next item's tile 0 instead of right
# after the copy (the working tree) against the last commit's forward (src/cuflash/kernels/_hf_base.py,
# a copy made for the run), two rounds (../2026-11-23-h100-fwd-max/ab_fwd.py), then the forward's GPU
# tests.
export PYTHONPATH=src
timeout 330 python benchmarks/results/2026-11-23-h100-fwd-max/ab_fwd.py 64,128 256,512,1024,2048,16384 2 > $OUT/ab_fwd_release.log 2>&1
timeout 200 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k "hopper_forward or hopper_short or route or causal" > $OUT/gpu_tests_release.log 2>&1
tail -n 3 $OUT/*.log
