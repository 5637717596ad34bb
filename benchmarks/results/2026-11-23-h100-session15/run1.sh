#!/bin/bash
# Device run 1 of session 15: the forward's next-item opening overlapped with the last P V (new) against
# the committed kernel (base, src/cuflash/kernels/_hf_base.py, not committed): the forward GPU tests, then
# the side-by-side timing at the table's launches, two rounds.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $OUT/gpu.txt
timeout 200 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k "hopper_forward or hopper_short or route or causal or length" > $OUT/gpu_tests_fwd.log 2>&1
tail -n 3 $OUT/gpu_tests_fwd.log
timeout 330 python3 benchmarks/results/2026-11-23-h100-fwd-max/ab_fwd.py 64,128 512,1024,2048,4096,16384 2 > $OUT/ab_fwd_opening.log 2>&1
cat $OUT/ab_fwd_opening.log
