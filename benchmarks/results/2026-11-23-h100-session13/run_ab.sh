#!/bin/bash
# GPU tests of the backward, then the A/B of the backward kernels (the working tree against
# src/cuflash/kernels/_hb_base.py, a copy of the last commit's, not committed), then the Gluon
# forward against the Triton one where the table takes Triton (D=64 causal up to 1k keys).
export PYTHONPATH=src PYTHONUNBUFFERED=1
tag=$1
python3 -m pytest tests -m gpu -k "hopper_backward or hopper_short or route" -q -n 8 -p no:cacheprovider \
  > $OUT/gpu_tests_${tag}.log 2>&1
tail -1 $OUT/gpu_tests_${tag}.log
python3 benchmarks/results/2026-11-23-h100-ncu/ab_bwd.py ${2:-128,64} ${3:-1024,4096,16384} ${4:-2} 2>&1 \
  | tee $OUT/ab_bwd_${tag}.log
if [ -n "$5" ]; then
  for r in 1 2; do echo "# round $r"; python3 scripts/tune.py --seqlen 768,1024 --hdims 64 --loads triton,gluon2 \
    --kernels fwd; done 2>&1 | tee $OUT/tune_d64_fwd_short.log
fi
