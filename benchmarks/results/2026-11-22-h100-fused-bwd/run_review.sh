export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 12 -k "kvcache or hopper_backward or deterministic or launch_plans" 2>&1 | tail -3 | tee $OUT/gpu_tests_review.log
