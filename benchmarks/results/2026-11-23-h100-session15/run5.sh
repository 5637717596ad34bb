#!/bin/bash
# Device run 5 of session 15: `cuflash bench` (device times, host time per call beside them), bf16,
# 16k tokens: forward 128..16k keys, backward 512..16k.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 270 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes fwd \
  --seqlens 128,256,512,1024,2048,4096,8192,16384 --out $OUT/bench_fwd 2>&1 | tr '\r' '\n' | grep "^| none"
timeout 300 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes bwd \
  --seqlens 512,1024,2048,4096,8192,16384 --out $OUT/bench_bwd 2>&1 | tr '\r' '\n' | grep "^| none"
