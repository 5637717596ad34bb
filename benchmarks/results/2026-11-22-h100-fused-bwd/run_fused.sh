export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 8 -k "hopper_backward and False-torch and -128-" 2>&1 | tail -8 | tee $OUT/gpu_tests_fused_alternate_parts.log
timeout 300 python benchmarks/results/2026-11-22-h100-fused-bwd/ab_fused_tma.py --hdims 128 2>&1 | tee $OUT/ab_fused_alternate_parts.log
