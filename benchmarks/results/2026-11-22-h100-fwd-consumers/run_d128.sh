export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest tests/test_gpu.py -k "hopper_forward or hopper_short" -q -n 15 -p no:cacheprovider 2>&1 | tail -2 | tee $OUT/gpu_tests_d128.log
timeout 300 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 128 --modes fwd --out $OUT/bench_fwd_d128 2>&1 | grep -v "^\[" | tail -16
