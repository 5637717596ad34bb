#!/bin/bash
# Device run 10 of session 15: the D=256 forward's launch candidates at 512 and 1k keys (its causal row at
# 512 read 0.96x sdpa-flash; the table has one D=256 launch for every length).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 560 python3 scripts/tune.py --hdims 256 --seqlen 512,1024 --kernels fwd 2>&1 | grep -v "^  (failed" | tee $OUT/tune_d256_fwd_short.log
