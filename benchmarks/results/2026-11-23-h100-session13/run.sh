#!/bin/bash
# The session's last tree: the whole GPU suite, then the forward and backward sweeps.
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -m pytest tests -m gpu -q -n 15 -p no:cacheprovider > $OUT/gpu_tests_full.log 2>&1
tail -1 $OUT/gpu_tests_full.log
for mode in fwd bwd; do
  timeout 200 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes $mode \
    --out $OUT/bench_$mode 2>&1 | tr '\r' '\n' | grep "^| none"
done
