#!/bin/bash
# The tree with the Gluon dK/dV at every length: the whole GPU suite, then the backward sweep from 256 keys.
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -m pytest tests -m gpu -q -n 15 -p no:cacheprovider > $OUT/gpu_tests_final.log 2>&1
tail -1 $OUT/gpu_tests_final.log
timeout 250 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes bwd \
  --seqlens 128,256,512,1024,2048,4096,8192,16384 --out $OUT/bench_bwd_final 2>&1 | tr '\r' '\n' | grep "^| none"
