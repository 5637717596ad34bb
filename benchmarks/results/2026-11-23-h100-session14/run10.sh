#!/bin/bash
# Device run 10 of session 14: the deferred release at D=128 only (the working tree) against the
# last commit's forward (src/cuflash/kernels/_hf_base.py, a copy made for the run), two rounds; the
# forward's GPU tests; the forward sweep on the final tree (bf16, 128 to 16k keys).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python benchmarks/results/2026-11-23-h100-fwd-max/ab_fwd.py 64,128 1024,2048 2 > $OUT/ab_fwd_release_d128.log 2>&1
timeout 200 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k "hopper_forward or hopper_short or route or causal" > $OUT/gpu_tests_release_d128.log 2>&1
tail -n 1 $OUT/gpu_tests_release_d128.log
timeout 180 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes fwd \
  --seqlens 128,256,512,1024,2048,4096,8192,16384 --out $OUT/bench_fwd_release 2>&1 | tr '\r' '\n' | grep "^| none"
