#!/bin/bash
# Device run 7 of session 16: the closing sweep of issue 3, part 2: bf16 backward at D=64/128 (512 to 16k keys)
# against cuDNN and flash; fp16 forward and backward at 2k and 8k; fp32 at 1k and 4k against sdpa-efficient.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 300 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes bwd \
  --seqlens 512,1024,2048,4096,8192,16384 --out $OUT/final_bwd 2>&1 | tr '\r' '\n' | grep "^| none"
timeout 120 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes fwd,bwd \
  --seqlens 2048,8192 --dtype fp16 --out $OUT/final_fp16 2>&1 | tr '\r' '\n' | grep "^| none"
timeout 160 python3 -m cuflash bench --providers cuflash,sdpa-efficient --hdims 64,128 --modes fwd,bwd \
  --seqlens 1024,4096 --dtype fp32 --out $OUT/final_fp32 2>&1 | tr '\r' '\n' | grep "^| none"
