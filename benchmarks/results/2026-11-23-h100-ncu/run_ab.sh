#!/bin/bash
# GPU tests of the backward, the A/B of the backward kernels (working tree against _hb_base.py), and
# Nsight Compute on the working tree's dK/dV kernel at D=128, 16k keys, non-causal.
export PYTHONPATH=src PYTHONUNBUFFERED=1
here=benchmarks/results/2026-11-23-h100-ncu
python3 -m pytest tests -m gpu -k "hopper_backward" -q -n 8 -p no:cacheprovider > $OUT/gpu_tests_${1}.log 2>&1
tail -1 $OUT/gpu_tests_${1}.log
python3 $here/ab_bwd.py ${2:-128,64} ${3:-1024,4096,16384} ${4:-2} 2>&1 | tee $OUT/ab_bwd_${1}.log
ncu --clock-control none --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section SourceCounters -k regex:dkdv -f -o $OUT/ncu_dkdv_${1} \
  python3 $here/ncu_target.py 128 16384 0 > /dev/null 2>&1
ncu -i $OUT/ncu_dkdv_${1}.ncu-rep --page source --print-source sass --csv 2>&1 | gzip > $OUT/sass_dkdv_${1}.csv.gz
ncu -i $OUT/ncu_dkdv_${1}.ncu-rep --page details 2>&1 | grep -i "duration\|tensor\|Warp Cycles Per Issued" | head
