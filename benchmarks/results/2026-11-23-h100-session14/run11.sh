#!/bin/bash
# Device run 11 of session 14: the deferred release at D=128 only, its code inside the item's tile
# block (D=64's SASS then instruction for instruction the last commit's, checked offline), against the
# last commit's forward (src/cuflash/kernels/_hf_base.py, a copy made for the run), two rounds; the
# forward's GPU tests; the D=128 forward sweep on this tree.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python benchmarks/results/2026-11-23-h100-fwd-max/ab_fwd.py 128 1024,2048,16384 2 > $OUT/ab_fwd_release_final.log 2>&1
timeout 200 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k "hopper_forward or hopper_short or route or causal" > $OUT/gpu_tests_release_final.log 2>&1
tail -n 1 $OUT/gpu_tests_release_final.log
timeout 120 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 128 --modes fwd \
  --seqlens 512,1024,2048,4096,8192,16384 --out $OUT/bench_fwd_d128 2>&1 | tr '\r' '\n' | grep "^| none"
cat $OUT/ab_fwd_release_final.log
