#!/bin/bash
# Device run 2 of session 16: D=256 at short lengths (the issue's >= 1.0x sdpa-flash at D=256 and at 128-256
# keys): the bench at 128-512 keys, then the launch candidates at 128 and 256 keys.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 150 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 256 --modes fwd,bwd \
  --seqlens 128,256,512 --out $OUT/bench_d256_short 2>&1 | tr '\r' '\n' | grep "^| none"
timeout 420 python3 scripts/tune.py --hdims 256 --seqlen 128,256 2>&1 | grep -v "^  (failed" | tee $OUT/tune_d256_short.log
