export PYTHONPATH=src
timeout 200 python benchmarks/results/2026-11-22-h100-short-gluon/ab_short_rotated.py 2>&1 | tee $OUT/ab_short_rotated.log
