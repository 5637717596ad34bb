#!/bin/bash
# Device run 4 of session 16: the Gluon forward at D=256 (new): its GPU tests (and the Gluon forward's others),
# then the side-by-side timing against the table's Triton launch at 128 to 16k keys.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 300 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 15 -x -k "hopper_forward or d256" > $OUT/gpu_tests_fwd_d256.log 2>&1
tail -n 3 $OUT/gpu_tests_fwd_d256.log
timeout 280 python3 $(dirname $0)/ab_fwd_d256.py 128,256,512,1024,2048,4096,16384 1 2>&1 | tee $OUT/ab_fwd_d256.log
