#!/bin/bash
# Device run 6 of session 16: the closing sweep of issue 3 on the session's last tree, part 1: bf16 forward at
# D=64/128/256 (128 to 16k keys) and the D=256 backward (512 to 16k), against cuDNN and flash.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 360 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128,256 --modes fwd \
  --seqlens 128,256,512,1024,2048,4096,8192,16384 --out $OUT/final_fwd 2>&1 | tr '\r' '\n' | grep "^| none"
timeout 200 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 256 --modes bwd \
  --seqlens 512,1024,2048,4096,8192,16384 --out $OUT/final_bwd_d256 2>&1 | tr '\r' '\n' | grep "^| none"
