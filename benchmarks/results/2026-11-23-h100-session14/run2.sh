#!/bin/bash
# Device run 2 of session 14: the forward's tiles at short causal lengths (ab_fwd_tiles.py, two rounds,
# the tentative table as "table") and the Gluon forward's GPU tests with 64-key tiles.
R=benchmarks/results/2026-11-23-h100-session14
export PYTHONPATH=src
timeout 330 python $R/ab_fwd_tiles.py 64,128 128,256,384,512,640,768,896,1024 2 1 > $OUT/ab_fwd_tiles_causal.log 2>&1
# timeout 200 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k hopper_forward > $OUT/gpu_tests_fwd_tiles.log 2>&1
tail -n 3 $OUT/*.log
