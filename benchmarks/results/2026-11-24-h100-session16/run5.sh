#!/bin/bash
# Device run 5 of session 16: the whole GPU suite with the Gluon forward at D=256 in the table, then the D=256
# sweep of the forward (128 to 16k keys) against cuDNN and flash.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/gpu.txt
timeout 450 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 > $OUT/gpu_tests_full.log 2>&1
tail -n 1 $OUT/gpu_tests_full.log
timeout 130 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 256 --modes fwd \
  --seqlens 128,256,512,1024,2048,4096,8192,16384 --out $OUT/bench_d256_fwd 2>&1 | tr '\r' '\n' | grep "^| none"
