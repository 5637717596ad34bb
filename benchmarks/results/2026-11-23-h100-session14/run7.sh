#!/bin/bash
# Device run 7 of session 14: the Gluon forward's tiles at 64-256 keys (ab_fwd_tiles.py, two rounds):
# non-causal at 64, 128, 144, 192, 256; causal at 64, 128.
R=benchmarks/results/2026-11-23-h100-session14
export PYTHONPATH=src
timeout 200 python $R/ab_fwd_tiles.py 64,128 64,128,144,192,256 2 0 > $OUT/ab_fwd_tiles_class01_nc.log 2>&1
timeout 150 python $R/ab_fwd_tiles.py 64,128 64,128 2 1 > $OUT/ab_fwd_tiles_class0_causal.log 2>&1
tail -n 3 $OUT/*.log
