#!/bin/bash
# Device run 3 of session 15: the P V wait kept after the softmax's exponentials by a branch on their sum
# (new: and P from shared memory at D=64; reg: P in registers everywhere) against the committed kernel;
# the forward GPU tests of new, then the side-by-side timing, two rounds.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k "hopper_forward or hopper_short or route or causal" > $OUT/gpu_tests_wait.log 2>&1
tail -n 2 $OUT/gpu_tests_wait.log
timeout 360 python3 benchmarks/results/2026-11-23-h100-session15/ab_fwd_mods.py 64,128 512,1024,2048,4096,16384 2 0,1 reg > $OUT/ab_fwd_wait.log 2>&1
cat $OUT/ab_fwd_wait.log
