#!/bin/bash
# Device run 11 of session 15: the D=256 forward's candidates again at 256, 384 and 512 keys (a second
# round for run 10's causal 512 row, where (128, 32, 8, 3) read +4% over the table's launch).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 560 python3 scripts/tune.py --hdims 256 --seqlen 256,384,512 --kernels fwd 2>&1 | grep -v "^  (failed" | tee $OUT/tune_d256_fwd_short_round2.log
