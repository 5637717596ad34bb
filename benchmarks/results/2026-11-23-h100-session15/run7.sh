#!/bin/bash
# Device run 7 of session 15: host time by part after set_materialize_grads(False); `cuflash bench` (device
# times) at D=256 (bf16, fwd and bwd, 512..16k) and fp32 (D=64/128 against sdpa-efficient, 1k and 4k).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 100 python3 $(dirname $0)/host_bwd_parts.py 2>&1 | tee $OUT/host_bwd_parts_nomat.log
timeout 250 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 256 --modes fwd,bwd \
  --seqlens 512,1024,2048,4096,8192,16384 --out $OUT/bench_d256 2>&1 | tr '\r' '\n' | grep "^| none"
timeout 200 python3 -m cuflash bench --providers cuflash,sdpa-efficient --hdims 64,128 --modes fwd,bwd \
  --seqlens 1024,4096 --dtype fp32 --out $OUT/bench_fp32 2>&1 | tr '\r' '\n' | grep "^| none"
