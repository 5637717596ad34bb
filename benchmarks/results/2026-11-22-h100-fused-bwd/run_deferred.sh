export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 8 -k "hopper_backward and True-torch" 2>&1 | tail -3 | tee $OUT/gpu_tests_fused_deferred.log
timeout 330 python benchmarks/results/2026-11-22-h100-fused-bwd/ab_fused_deferred.py 2>&1 | tee $OUT/ab_fused_deferred.log
