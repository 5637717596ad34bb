#!/bin/bash
# Device run 3 of session 14: the forward's tiles at 160-256 causal keys (length class 1) and 8 K/V
# buffers at D=64 (ab_fwd_tiles.py, two rounds).
R=benchmarks/results/2026-11-23-h100-session14
export PYTHONPATH=src
timeout 330 python $R/ab_fwd_tiles.py 64,128 160,192,256,512,768,1024 2 1 > $OUT/ab_fwd_tiles_class1.log 2>&1
tail -n 3 $OUT/*.log
