#!/bin/bash
# Device run 6 of session 15: the D=64 backward at 4k-16k again (run 5's 8k non-causal row read 0.97x),
# and the fp16 forward at 128 and 256 keys (host-caught rows before the device-only timing).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 150 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64 --modes bwd \
  --seqlens 4096,8192,16384 --out $OUT/bench_bwd_d64_recheck 2>&1 | tr '\r' '\n' | grep "^| none"
timeout 150 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes fwd \
  --seqlens 128,256 --dtype fp16 --out $OUT/bench_fwd_fp16_short 2>&1 | tr '\r' '\n' | grep "^| none"
