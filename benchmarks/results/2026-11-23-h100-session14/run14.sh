#!/bin/bash
# Device run 14 of session 14: the D=64 non-causal forward with 3 consumers and 64-key tiles at 144-256
# and 640-1024 keys (ab_fwd_tiles.py, two rounds); test_hopper_forward with it forced (3 consumers,
# 64-key tiles among the cases).
R=benchmarks/results/2026-11-23-h100-session14
export PYTHONPATH=src
timeout 250 python $R/ab_fwd_tiles.py 64 144,192,256,640,768,896,1024 2 0 table,g2n64s6,g3n64s6,g3n128 > $OUT/ab_fwd_tiles_d64_g3.log 2>&1
timeout 200 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k "hopper_forward" > $OUT/gpu_tests_fwd_g3.log 2>&1
tail -n 1 $OUT/gpu_tests_fwd_g3.log
cat $OUT/ab_fwd_tiles_d64_g3.log
