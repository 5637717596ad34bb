#!/bin/bash
# Device run 6 of session 14: the short forward rows' host time (fwd_host.py) and the Gluon forward's
# tiles at 128-256 keys non-causal (ab_fwd_tiles.py, two rounds).
R=benchmarks/results/2026-11-23-h100-session14
export PYTHONPATH=src
timeout 150 python $R/fwd_host.py > $OUT/fwd_host.log 2>&1
timeout 300 python $R/ab_fwd_tiles.py 64,128 128,256 2 0 > $OUT/ab_fwd_tiles_short_nc.log 2>&1
tail -n 3 $OUT/*.log
