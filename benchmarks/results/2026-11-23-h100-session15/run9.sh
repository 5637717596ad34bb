#!/bin/bash
# Device run 9 of session 15: the D=256 backward's launch candidates at 8k keys on the H100 (the table's
# came from an H200 sweep at 4k); its causal rows read 0.95-0.98x sdpa-flash from 4k.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 560 python3 scripts/tune.py --hdims 256 --seqlen 8192 --kernels dkdv,dq 2>&1 | grep -v "^  (failed" | tee $OUT/tune_d256_8k.log
