#!/bin/bash
# Device run 5 of session 14: the tree with 64-key tiles in the short causal forward: the whole GPU
# suite, then the forward sweep from 128 keys (bf16, D=64/128).
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -m pytest tests -m gpu -q -n 15 -p no:cacheprovider > $OUT/gpu_tests_full.log 2>&1
tail -1 $OUT/gpu_tests_full.log
timeout 250 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes fwd \
  --seqlens 128,256,512,1024,2048,4096,8192,16384 --out $OUT/bench_fwd 2>&1 | tr '\r' '\n' | grep "^| none"
