#!/bin/bash
# The committed tree: GPU tests of the backward and the routing tests, then the backward sweep.
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -m pytest tests -m gpu -k "hopper_backward or hopper_short or route" -q -n 8 -p no:cacheprovider \
  > $OUT/gpu_tests_final.log 2>&1
tail -1 $OUT/gpu_tests_final.log
timeout 420 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes bwd \
  --out $OUT/bench_bwd 2>&1 | grep -v "it/s\]" | tail -30
