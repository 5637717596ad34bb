#!/bin/bash
# Device run 12 of session 15: the D=256 banded forward at 129-512 keys on (128, 32, 8, 3): the GPU tests
# at D=256, then the forward sweep 256..2k against cuDNN and flash.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 300 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k "256" > $OUT/gpu_tests_d256.log 2>&1
tail -n 1 $OUT/gpu_tests_d256.log
timeout 200 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 256 --modes fwd \
  --seqlens 256,384,512,1024,2048 --out $OUT/bench_d256_fwd_short 2>&1 | tr '\r' '\n' | grep "^| none"
