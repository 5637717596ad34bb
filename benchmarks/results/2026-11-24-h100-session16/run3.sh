#!/bin/bash
# Device run 3 of session 16: the D=256 forward's candidates at 128-384 keys, with one-stage and 64-row
# launches that leave room for two programs an SM (run 2: the table's launch 0.81-0.93x sdpa-flash there).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 400 python3 scripts/tune.py --hdims 256 --seqlen 128,256,384 --kernels fwd 2>&1 | grep -v "^  (failed" | tee $OUT/tune_d256_fwd_short.log
