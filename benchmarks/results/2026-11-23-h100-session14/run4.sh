#!/bin/bash
# Device run 4 of session 14: the causal forward's errors with the new table (precision_fwd.py), the
# backward step's host time (host_profile.py), and the GPU tests of the forward and the routing.
R=benchmarks/results/2026-11-23-h100-session14
export PYTHONPATH=src
timeout 120 python $R/precision_fwd.py > $OUT/precision_fwd.log 2>&1
timeout 120 python $R/host_profile.py > $OUT/host_profile.log 2>&1
timeout 300 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -k "hopper_forward or hopper_short or route or causal" > $OUT/gpu_tests_fwd.log 2>&1
tail -n 3 $OUT/*.log
