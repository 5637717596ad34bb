#!/bin/bash
# GPU tests of the backward, then Nsight Compute (full set, clocks left alone) on the Gluon kernels of
# one forward + backward per case; details and SASS-level stall samples as text.
export PYTHONPATH=src
here=benchmarks/results/2026-11-23-h100-ncu
python3 -m pytest tests -m gpu -k "hopper_backward" -q -n 8 -p no:cacheprovider > $OUT/gpu_tests_bwd.log 2>&1
tail -2 $OUT/gpu_tests_bwd.log
for case in "$@"; do
  set -- $case
  name=D$1_N$2_c$3
  timeout 150 ncu --clock-control none --profile-from-start off --set full -k regex:hopper -f -o $OUT/$name \
    python3 $here/ncu_target.py $1 $2 $3 > $OUT/$name.log 2>&1
  tail -3 $OUT/$name.log
  ncu -i $OUT/$name.ncu-rep --page details > $OUT/details_$name.txt 2>&1
  ncu -i $OUT/$name.ncu-rep --page source --print-source sass --csv > $OUT/sass_$name.csv 2>&1
  ls -la $OUT/sass_$name.csv
done
