export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 8 -k "hopper_forward" 2>&1 | tail -3 | tee $OUT/gpu_tests_split.log
timeout 200 python benchmarks/results/2026-11-22-h100-fma-exp/ab_fwd_exp.py 2>&1 | tee $OUT/ab_fwd_exp.log
