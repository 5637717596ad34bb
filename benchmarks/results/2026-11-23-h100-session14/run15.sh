#!/bin/bash
# Device run 15 of session 14, the final table (D=64 non-causal 257-512 keys: three consumers, 64-key
# tiles): the GPU tests of the forward, the short lengths and the routing; the forward sweep 256-1k.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 250 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k "hopper_forward or hopper_short or route or causal or length" > $OUT/gpu_tests_class2.log 2>&1
tail -n 1 $OUT/gpu_tests_class2.log
timeout 100 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes fwd \
  --seqlens 256,384,512,1024 --out $OUT/bench_fwd_short 2>&1 | tr '\r' '\n' | grep "^| none"
