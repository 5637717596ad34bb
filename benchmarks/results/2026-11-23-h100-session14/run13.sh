#!/bin/bash
# Device run 13 of session 14: the D=64 forward at 257-512 keys (the Triton forward in the table) against
# the Gluon forward with 128- or 64-key tiles, 2 or 3 consumers (ab_fwd_tiles.py, two rounds).
R=benchmarks/results/2026-11-23-h100-session14
export PYTHONPATH=src
timeout 300 python $R/ab_fwd_tiles.py 64 320,384,448,512 2 0,1 table,g2n128,g2n64s6,g3n64s6 > $OUT/ab_fwd_tiles_d64_class2.log 2>&1
cat $OUT/ab_fwd_tiles_d64_class2.log
